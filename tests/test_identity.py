"""Rank identity from Slurm's or the local launcher's variables, and the rendezvous port."""

from __future__ import annotations

import subprocess

import pytest

from hpc_rl.config import load_config
from hpc_rl.plan import build_plan
from hpc_rl.runtime.identity import identity_from_env, rendezvous_port, role_offsets


@pytest.fixture(scope="module")
def ultra_plan():
    return build_plan(load_config(["+recipe=ultra_mopd"]))


def test_global_ranks_follow_role_order(ultra_plan):
    offsets = role_offsets(ultra_plan)
    assert offsets["trainer"] == (0, 256)
    assert offsets["generator"] == (256, 512)
    assert offsets["teacher/general"] == (768, 16)
    assert offsets["env"] == (768 + 5 * 16, 12)


def test_identity_from_slurm_variables(ultra_plan):
    env = {"HPC_RL_ROLE": "generator", "SLURM_PROCID": "37", "SLURM_NTASKS": "512", "SLURM_LOCALID": "1",
           "SLURMD_NODENAME": "rack3-n07", "SLURM_RESTART_COUNT": "2", "HPC_RL_JOB_ID": "9001"}
    ident = identity_from_env(ultra_plan, env)
    assert (ident.role, ident.role_rank, ident.role_size) == ("generator", 37, 512)
    assert ident.global_rank == 256 + 37 and ident.world_size == 256 + 512 + 80 + 12
    assert (ident.local_rank, ident.node, ident.restart, ident.job_id) == (1, "rack3-n07", 2, "9001")


def test_identity_errors_name_the_problem(ultra_plan):
    with pytest.raises(RuntimeError, match="roles of this plan"):
        identity_from_env(ultra_plan, {"HPC_RL_ROLE": "critic", "SLURM_PROCID": "0"})
    with pytest.raises(RuntimeError, match="started 8 tasks .* the plan has 16"):
        identity_from_env(ultra_plan, {"HPC_RL_ROLE": "teacher/swe", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"})


@pytest.mark.parametrize("job_id,restart", [("12345", 0), ("12345", 3), ("7", 1), ("local-4242", 0), ("101", 0)])
def test_port_formula_matches_the_batch_shell_and_avoids_ephemeral_ports(job_id, restart):
    from hpc_rl.runtime.identity import ephemeral_low
    from hpc_rl.slurm.sbatch import PORT_LINES

    # the rendered script's own lines, run by bash
    script = "\n".join(PORT_LINES) + '\necho "$HPC_RL_MASTER_PORT"'
    out = subprocess.run(["bash", "-c", script], env={"SLURM_JOB_ID": job_id, "HPC_RL_RESTART": str(restart),
                                                      "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout
    port = rendezvous_port(job_id, restart)
    assert int(out) == port
    assert port != rendezvous_port(job_id, restart + 1)
    # job 101 got 33231 from the old formula: inside the ephemeral range (32768-60999 here),
    # where an outgoing connection held it and the store failed with EADDRINUSE
    assert 20000 <= port < ephemeral_low()
    assert rendezvous_port("101", 0, eph_low=32768) < 32768 and rendezvous_port("101", 0, eph_low=10000) < 30000

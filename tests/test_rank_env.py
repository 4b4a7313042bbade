"""RankEnv: the HPC_RL_* names in one place, read with Slurm's equivalents as fallbacks,
written by the local launcher and exported by the rendered batch shell."""

from __future__ import annotations

import dataclasses
import re

import pytest

from hpc_rl.config import load_config
from hpc_rl.plan import build_plan
from hpc_rl.runtime import env
from hpc_rl.runtime.env import RankEnv
from hpc_rl.slurm.sbatch import RenderOptions, render


def test_hpc_rl_names_win_over_slurm_and_empty_counts_as_unset():
    e = RankEnv.from_env({env.ROLE: "generator", "SLURM_PROCID": "37", env.ROLE_RANK: "", "SLURM_NTASKS": "512",
                          env.JOB_ID: "", "SLURM_HET_JOB_ID": "900", "SLURM_JOB_ID": "901", env.LOCAL_RANK: "2",
                          "SLURM_LOCALID": "1", env.PICKLED: "1", env.MASTER_PORT: "23456"})
    assert (e.role, e.role_rank, e.role_size, e.local_rank) == ("generator", 37, 512, 2)
    assert e.job_id == "900"  # the het job's (leader's) id, not the component's
    assert e.pickled is True and e.master_port == 23456 and e.node is None and e.restart is None


def test_to_env_round_trips_and_names_only_what_is_set():
    e = RankEnv(role="teacher/math", role_rank=1, role_size=2, local_rank=1, node="local0", restart=0,
                job_id="local-7", run_dir="/r", master_addr="127.0.0.1", master_port=20001, pickled=False)
    out = e.to_env()
    assert set(out) <= {f.metadata["env"] for f in dataclasses.fields(RankEnv)}
    assert env.PLACED_RANK not in out and out[env.PICKLED] == "0" and out[env.ROLE] == "teacher/math"
    assert RankEnv.from_env(out) == e


def test_a_malformed_value_names_its_variable():
    with pytest.raises(ValueError, match="SLURM_PROCID='x'"):
        RankEnv.from_env({"SLURM_PROCID": "x"})


def test_every_name_is_an_hpc_rl_name_and_unique():
    names = [f.metadata["env"] for f in dataclasses.fields(RankEnv)]
    assert len(set(names)) == len(names) and all(n.startswith("HPC_RL_") for n in names)
    assert set(env.CONTAINER_ENV) <= set(names) | {env.JOB_KEY}  # the secret is no RankEnv field: never printed
    assert env.JOB_KEY.startswith("HPC_RL_") and env.JOB_KEY not in names


def test_the_batch_shell_exports_what_every_rank_reads():
    cfg = load_config(["+recipe=comm_check", "cluster=local_slurm"])
    text = render(cfg, build_plan(cfg), RenderOptions(run_dir="/runs/x"))
    exported = set(re.findall(r"^export (HPC_RL_\w+)=", text, re.M))
    assert exported == {env.RESTART, env.RUN_DIR, env.JOB_ID, env.PICKLED, env.MASTER_ADDR, env.MASTER_PORT, env.JOB_END,
                        env.JOB_KEY}
    assert f"{env.ROLE}=$role srun" in text  # per role, on the srun line
    # every HPC_RL_ name the script mentions is one RankEnv knows
    known = {f.metadata["env"] for f in dataclasses.fields(RankEnv)} | {env.JOB_KEY}
    assert set(re.findall(r"HPC_RL_\w+", text)) <= known

"""Checks of the localhost Slurm cluster itself (launchers/local_slurm.sh).

If these fail, every other `slurm`-marked test will too; look here first.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

# Bound every Slurm interaction: a broken cluster must fail the test, not hang it.
_CMD_TIMEOUT_S = 30
_JOB_TIMEOUT_S = 120
_TERMINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "BOOT_FAIL", "DEADLINE",
}


def _run(args: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=_CMD_TIMEOUT_S)
    assert proc.returncode == 0, f"{args} failed (rc={proc.returncode}): {proc.stderr}{proc.stdout}"
    return proc.stdout


def test_cluster_shape(local_slurm):
    out = _run(["sinfo", "-h", "-N", "-p", local_slurm.partition, "-o", "%N|%G|%c|%T"],
               env=local_slurm.env())
    rows = sorted(line.split("|") for line in out.strip().splitlines())
    assert [r[0] for r in rows] == list(local_slurm.nodes)
    for name, gres, cpus, state in rows:
        assert gres == f"gpu:{local_slurm.gpus_per_node}", (name, gres)
        assert cpus == "8", (name, cpus)
        assert state in {"idle", "mixed", "allocated", "completing"}, (name, state)

    topo = _run(["scontrol", "show", "topology"], env=local_slurm.env())
    switches = {m[0]: m[1] for m in re.findall(r"SwitchName=(\S+) .*?Nodes=(\S+)", topo)}
    assert switches.get("rack1") == "node[1-2]", topo
    assert switches.get("rack2") == "node[3-4]", topo
    assert switches.get("rack3") == "node[5-6]", topo
    assert switches.get("spine") == "node[1-6]", topo
    assert re.search(r"SwitchName=spine .*Switches=rack\[1-3\]", topo), topo


def test_plain_clients_need_no_slurm_conf(local_slurm):
    # /etc/slurm/slurm.conf links to the cluster's conf, so tools and users that never
    # heard of SLURM_CONF reach the same cluster.
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    out = _run(["sinfo", "-h", "-o", "%P %D"], env=env)
    assert out.split() == [f"{local_slurm.partition}*", str(len(local_slurm.nodes))]


def _job_states(job_id: str, env: dict[str, str]) -> dict[int, dict[str, str]]:
    """{HetJobOffset: scontrol fields} for every component of het job `job_id`.

    Each component is a job of its own (JobId = leader id + offset); there is no
    accounting DB here, so this relies on MinJobAge keeping finished jobs visible.
    """
    out = _run(["scontrol", "-o", "show", "job", job_id], env=env)
    comps = {}
    for line in out.strip().splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        comps[int(fields["HetJobOffset"])] = fields
    return comps


def _read_marker(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_het_job_smoke(local_slurm, tmp_path):
    env = local_slurm.env()
    # Each component's step writes a marker: which het group it is, where it ran, and
    # what Slurm told it. Single quotes: variables expand inside the step, not here.
    step = (
        "bash -c 'f={out}/het{k}.$SLURM_PROCID.txt; {{ "
        "echo component={k}; echo procid=$SLURM_PROCID; echo host=$(hostname); "
        "echo node=$SLURMD_NODENAME; echo topo=$SLURM_TOPOLOGY_ADDR; "
        "echo job_id=$SLURM_JOB_ID; echo comp_job_id=$SLURM_JOB_ID_HET_GROUP_{k}; "
        "echo het_size=$SLURM_HET_SIZE; echo gpus=${{SLURM_GPUS_ON_NODE:-0}}; "
        "}} > $f.tmp && mv $f.tmp $f'"
    )
    script = tmp_path / "het_smoke.sbatch"
    script.write_text(
        f"""#!/bin/bash
#SBATCH --job-name=hpc_rl_het_smoke
#SBATCH --partition={local_slurm.partition}
#SBATCH --output={tmp_path}/slurm-%j.out
#SBATCH --time=2
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH hetjob
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --gres=gpu:1
set -euo pipefail
srun --het-group=0 {step.format(out=tmp_path, k=0)}
srun --het-group=1 {step.format(out=tmp_path, k=1)}
echo batch-done
"""
    )

    job_id = _run(["sbatch", "--parsable", str(script)], env=env).strip().split(";")[0]
    assert job_id.isdigit(), job_id

    deadline = time.monotonic() + _JOB_TIMEOUT_S
    comps: dict[int, dict[str, str]] = {}
    while time.monotonic() < deadline:
        comps = _job_states(job_id, env)
        if comps and all(c["JobState"] in _TERMINAL_STATES for c in comps.values()):
            break
        time.sleep(0.5)
    else:
        subprocess.run(["scancel", job_id], env=env, timeout=_CMD_TIMEOUT_S)
        pytest.fail(f"het job {job_id} not finished after {_JOB_TIMEOUT_S}s: {comps}")

    log = "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert sorted(comps) == [0, 1], comps
    for k, c in comps.items():
        assert c["HetJobId"] == job_id
        assert (c["JobState"], c["ExitCode"]) == ("COMPLETED", "0:0"), f"component {k}: {c}\n{log}"
    assert "batch-done" in log

    markers = {k: _read_marker(tmp_path / f"het{k}.0.txt") for k in (0, 1)}
    for k, m in markers.items():
        assert m["component"] == str(k)
        assert m["procid"] == "0"
        # Slurm 22.05 sets no SLURM_HET_JOB_ID: SLURM_JOB_ID is the leader's id in every
        # component, and SLURM_JOB_ID_HET_GROUP_<k> the component's own job id.
        assert m["job_id"] == job_id
        assert m["comp_job_id"] == comps[k]["JobId"] == str(int(job_id) + k)
        assert m["het_size"] == "2"
        assert m["node"] in local_slurm.nodes
        # All emulated nodes are this host.
        assert m["host"] == os.uname().nodename
        # Tree topology: spine.rackN.nodeK.
        rack = f"rack{(int(m['node'][4:]) + 1) // 2}"
        assert m["topo"] == f"spine.{rack}.{m['node']}", m
    # Only component 1 asked for a (fake) GPU. Fake GPUs are plain files, which Slurm
    # can't map to a device index, so CUDA_VISIBLE_DEVICES stays unset; the count shows.
    assert markers[0]["gpus"] == "0"
    assert markers[1]["gpus"] == "1"

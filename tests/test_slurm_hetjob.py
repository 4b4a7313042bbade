"""Het jobs on the real local Slurm cluster, through the submitit-based executor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.plan import build_plan
from hpc_rl.rundir import prepare_run_dir
from hpc_rl.slurm.executor import job_from_run_dir
from hpc_rl.launchers.slurm import submit
from hpc_rl.slurm.preflight import check_slurm
from hpc_rl.slurm.watch import follow

COMM_CHECK = ["+recipe=comm_check", "cluster=local_slurm", "launcher=slurm"]
PAYLOAD_SUM = sum(3.0 * i + 1.0 for i in range(16))


def _launch(*overrides, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "hpc_rl.launch", *COMM_CHECK, *overrides], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _submit(tmp_path, *overrides):
    cfg = load_config([*COMM_CHECK, f"run.dir={tmp_path / 'run'}", *overrides])
    plan = build_plan(cfg)
    check_slurm(cfg, plan)
    return submit(cfg, plan, prepare_run_dir(cfg, plan))


@pytest.mark.slurm
def test_het_job_every_rank_meets_reduces_and_hears_the_trainer(local_slurm, tmp_path):
    t0 = time.monotonic()
    proc = _launch(f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 60, "launcher=slurm must not wait for the job"
    assert "submitted het job" in proc.stdout and "scancel" in proc.stdout and "hpc_rl.slurm.watch" in proc.stdout
    run_dir = tmp_path / "run"
    job = job_from_run_dir(run_dir)
    assert job.component_ids == [f"{job.job_id}+{k}" for k in range(4)]
    assert follow(job, poll_s=0.5, timeout_s=180, echo=lambda line: None) == "COMPLETED"

    results = job.results()  # submitit's own API over our per-rank result pickles
    assert [r["role"] for r in results] == ["trainer", "trainer", "generator", "teacher/math", "env"]
    trainer0, trainer1, generator, teacher, env = results
    assert trainer0["role_allreduce"] == trainer1["role_allreduce"] == 3.0
    assert generator["broadcasts"] == {"refit": PAYLOAD_SUM}
    assert teacher["broadcasts"] == {"teacher/math": PAYLOAD_SUM}
    assert env["broadcasts"] == {}
    # trainer: 2 tasks on 2 Slurm nodes; every component on its own node
    assert trainer0["node"] != trainer1["node"]
    assert len({r["node"] for r in results}) == 5
    assert all(r["topology_addr"].startswith("spine.rack") for r in results)
    for log in ("trainer", "generator", "teacher-math", "env"):
        assert "rendezvoused with 5 ranks" in (run_dir / "logs" / f"{log}.0.out").read_text()
    assert json.loads((run_dir / "job_exit.json").read_text())["exit_code"] == 0
    assert (run_dir / "job.sbatch").read_text().count("#SBATCH hetjob") == 3

    watch = subprocess.run([sys.executable, "-m", "hpc_rl.slurm.watch", str(run_dir)], capture_output=True, text=True, timeout=60)
    assert watch.returncode == 0 and f"job {job.job_id} COMPLETED" in watch.stdout


@pytest.mark.slurm
def test_a_failing_rank_ends_the_job_fast_naming_role_and_rank(local_slurm, tmp_path):
    job = _submit(tmp_path, "ft.inject_failure=generator:0")
    t0 = time.monotonic()
    state = follow(job, poll_s=0.5, timeout_s=120, echo=lambda line: None)
    assert state == "FAILED"
    assert time.monotonic() - t0 < 90
    failure = job.failure()
    assert failure.startswith("generator:0: RuntimeError: injected failure on generator:0"), failure
    rec = json.loads((tmp_path / "run" / "job_exit.json").read_text())
    assert rec["failed_role"] == "generator" and rec["exit_code"] != 0
    assert "injected failure" in rec["detail"] and "Connection closed" not in rec["detail"]
    assert "hpc_rl: job failed in role generator" in (tmp_path / "run" / "logs" / "batch.out").read_text()


@pytest.mark.slurm
def test_cancel(local_slurm, tmp_path):
    job = _submit(tmp_path)
    job.cancel()
    assert follow(job, poll_s=0.5, timeout_s=60, echo=lambda line: None) == "CANCELLED"
    assert set(job.component_states(force=True).values()) == {"CANCELLED"}


@pytest.mark.slurm
def test_preflight_rejects_unknown_partition_and_oversized_roles(local_slurm, tmp_path):
    proc = _launch("cluster.partition=gpu_h100", f"run.dir={tmp_path / 'a'}")
    assert proc.returncode == 2
    assert "cluster.partition = 'gpu_h100': the cluster has no partition 'gpu_h100'" in proc.stderr and "['local']" in proc.stderr
    proc = _launch("cluster.max_nodes=null", "trainer.nodes=8", "trainer.global_batch_size=8", "algo.prompts_per_step=8",
                   f"run.dir={tmp_path / 'b'}")
    assert proc.returncode == 2
    assert "trainer.nodes = 8: partition 'local' has 6 nodes" in proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing submitted, nothing written


def test_no_sbatch_suggests_the_other_launchers(tmp_path):
    env = dict(os.environ, PATH=str(Path(sys.executable).parent))  # python, but no Slurm clients
    proc = _launch(f"run.dir={tmp_path / 'run'}", env=env)
    assert proc.returncode == 2
    assert "sbatch is not on PATH" in proc.stderr and "launcher=local" in proc.stderr and "launcher=dry_run" in proc.stderr

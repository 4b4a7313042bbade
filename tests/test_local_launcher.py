"""launcher=local: the het-job scenario as processes on this machine, through the same
rank runtime (identity, TCPStore rendezvous, process groups) the Slurm tasks use."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from submitit.core import utils as submitit_utils

from hpc_rl.launchers.local import FAILED_ROLE_EXIT_BASE

COMM_CHECK = ["+recipe=comm_check", "launcher=local"]


def _launch(tmp_path, *overrides, timeout=180):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", *COMM_CHECK, f"run.dir={tmp_path / 'run'}", *overrides],
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def _results(run_dir: Path):
    out = {}
    for path in sorted((run_dir / "submitit").glob("*_result.pkl")):
        outcome, value = submitit_utils.pickle_load(path)
        rank = int(path.name.split("_")[-2])
        out[rank] = (outcome, value)
    return out


def _orphans(run_dir: Path):
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [ln for ln in ps.splitlines() if "hpc_rl.runtime.worker" in ln and str(run_dir) in ln]


def test_every_rank_rendezvouses_reduces_and_receives_the_broadcast(tmp_path):
    proc, _ = _launch(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "run"
    results = _results(run_dir)
    assert sorted(results) == [0, 1, 2, 3, 4]  # trainer x2, generator, teacher/math, env
    roles = {r: v["role"] for r, (_, v) in results.items()}
    assert roles == {0: "trainer", 1: "trainer", 2: "generator", 3: "teacher/math", 4: "env"}
    for rank, (outcome, value) in results.items():
        assert outcome == "success"
    payload_sum = sum(3.0 * i + 1.0 for i in range(16))
    assert results[0][1]["role_allreduce"] == 3.0 and results[1][1]["role_allreduce"] == 3.0  # 1 + 2
    assert results[2][1]["broadcasts"] == {"refit": payload_sum}  # generator hears the trainer
    assert results[3][1]["broadcasts"] == {"teacher/math": payload_sum}
    assert results[4][1]["broadcasts"] == {}  # env is in neither group
    assert results[0][1]["broadcasts"] == {"refit": payload_sum, "teacher/math": payload_sum}
    assert {results[0][1]["node"], results[1][1]["node"]} == {"local0", "local1"}  # trainer on 2 "nodes"
    for log in ("trainer.0.out", "generator.0.out", "teacher-math.0.out", "env.0.out"):
        assert "rendezvoused with 5 ranks" in (run_dir / "logs" / log).read_text()


def test_a_failing_rank_stops_everyone_fast_and_is_named(tmp_path):
    proc, seconds = _launch(tmp_path, "ft.inject_failure=generator:0")
    assert proc.returncode == FAILED_ROLE_EXIT_BASE + 1, proc.stdout + proc.stderr  # generator is component 1
    assert "run failed in generator:0" in proc.stderr and "injected failure" in proc.stderr
    assert seconds < 90, f"took {seconds:.0f}s: the other ranks were not stopped"
    run_dir = tmp_path / "run"
    assert not _orphans(run_dir)
    results = _results(run_dir)
    assert results[2][0] == "error" and "injected failure on generator:0" in results[2][1]
    assert (run_dir / "errors" / "generator.0.0.txt").read_text().startswith("generator:0: RuntimeError: injected failure")


def test_a_rank_killed_by_a_signal_is_named_by_it_end_to_end(tmp_path):
    """Issue 44: the launcher's line and the run's verdict name the signal, not a bare 137; the
    verdict is the rank supervisor's error report (runtime/death.py)."""
    proc, _ = _launch(tmp_path, "ft.inject_failure=generator:0:kill")
    assert proc.returncode == FAILED_ROLE_EXIT_BASE + 1, proc.stdout + proc.stderr
    assert "[local] generator:0 was killed by SIGKILL (signal 9); stopping" in proc.stdout, proc.stdout
    assert "run failed in generator:0 after" in proc.stderr
    assert "generator:0: was killed by SIGKILL (signal 9) from outside" in proc.stderr, proc.stderr
    assert not _orphans(tmp_path / "run")


def test_ranks_that_never_arrive_are_named_by_the_rendezvous(tmp_path):
    """A rank that cannot reach its peers fails within the rendezvous timeout, naming who is missing."""
    proc, _ = _launch(tmp_path, "launcher=dry_run")
    assert proc.returncode == 0
    run_dir = tmp_path / "run"
    env = dict(os.environ, HPC_RL_ROLE="trainer", HPC_RL_ROLE_RANK="0", HPC_RL_ROLE_SIZE="2", HPC_RL_MASTER_ADDR="127.0.0.1",
               HPC_RL_MASTER_PORT=str(_free_port()), HPC_RL_JOB_ID="alone")
    (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace("rendezvous_timeout_s: 120", "rendezvous_timeout_s: 3"))
    solo = subprocess.run([sys.executable, "-m", "hpc_rl.runtime.worker", str(run_dir)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert solo.returncode == 1
    assert "never arrived: trainer:1, generator:0, teacher/math:0, env:0" in solo.stderr


def _free_port():
    from hpc_rl.launchers.local import free_port

    return free_port()


def test_a_frozen_rank_is_found_by_heartbeats_and_every_rank_exits(tmp_path):
    # SIGSTOP freezes the whole generator process, heartbeat thread included: what a hung
    # node looks like. The supervisor sees a live process; only the heartbeats can tell.
    proc, seconds = _launch(tmp_path, "ft.inject_failure=generator:0:freeze", "ft.heartbeat_interval_s=0.5",
                            "ft.heartbeat_timeout_s=4")
    assert proc.returncode != 0
    verdict = (tmp_path / "run" / "errors" / "dead_rank.0.txt").read_text()
    assert verdict.startswith("generator:0 missed heartbeats for") and "ft.heartbeat_timeout_s=4" in verdict
    assert "generator:0 missed heartbeats" in proc.stderr
    # the frozen rank is named, not a peer that exited after losing it (ft/culprit.py)
    assert "run failed in generator:0" in proc.stderr and proc.returncode == FAILED_ROLE_EXIT_BASE + 1
    missed = float(verdict.split("for ")[1].split("s")[0])
    assert 4.0 <= missed < 6.0  # detected within one beat of the timeout
    assert seconds < 90

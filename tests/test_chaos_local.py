"""Chaos with the local launcher: a SIGKILL inside a checkpoint save, then a rerun in the
same run directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SMALL = ["+recipe=tiny_grpo", "run.max_steps=4", "algo.prompts_per_step=8", "algo.generations_per_prompt=2",
         "trainer.global_batch_size=16", "data.samples_per_task=16", "data.eval_prompts_per_task=0",
         "checkpoint.every_steps=2", "checkpoint.keep_last=2"]


def _launch(*args):
    return subprocess.run([sys.executable, "-m", "hpc_rl.launch", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_kill_during_a_save_keeps_the_previous_checkpoint_and_the_rerun_resumes_from_it(tmp_path):
    run = tmp_path / "run"
    # trainer:0 SIGKILLs itself inside the save of step 4: shards written, manifest not yet
    first = _launch(*SMALL, f"run.dir={run}", "ft.inject_failure=trainer:0:kill@save4")
    assert first.returncode != 0 and "trainer:0" in first.stderr
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_00000002"]
    assert any(p.name.startswith(".tmp_step_4_") for p in ckpts.iterdir())  # the half-written save
    assert json.loads((ckpts / "latest_checkpoint_status.json").read_text())["step"] == 2
    assert not (run / "FINISHED").exists()

    second = _launch(*SMALL, f"run.dir={run}")  # the same command again, no user action in between
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    (restart,) = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    # step 3 was recorded before the kill and is the one step computed twice
    assert restart["resumed_from_step"] == 2 and restart["steps_recomputed"] == 1
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_00000002", "step_00000004"]
    assert not any(p.name.startswith(".tmp_") for p in ckpts.iterdir())  # retention cleared the stale save
    assert (run / "FINISHED").exists()


@pytest.mark.slow
def test_a_rank_stuck_while_alive_is_named_by_the_progress_watchdog(tmp_path):
    run = tmp_path / "run"
    # the generator's main thread blocks at step 2 while its heartbeat thread goes on beating
    proc = _launch(*SMALL, f"run.dir={run}", "ft.inject_failure=generator:0:hang@2", "ft.progress_timeout_s=8")
    assert proc.returncode != 0
    verdict = (run / "errors" / "dead_rank.0.txt").read_text()
    # at work in step 2 while the trainer waits for its rows and the env rank for step 2's
    assert verdict.startswith("generator:0 made no progress for") and "stuck in 'step 2 sample'" in verdict
    assert "while the others wait in ['step 1 wait', 'step 2 wait_rows']" in verdict
    assert "generator:0 made no progress" in proc.stderr


def _live_processes_of(run_dir) -> list:
    """Live processes whose environment names this run directory (vLLM's children inherit it)."""
    from pathlib import Path

    from hpc_rl.runtime import env

    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if f"{env.RUN_DIR}={run_dir}".encode() + b"\0" not in (d / "environ").read_bytes():
                continue
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(int(d.name))
    return out


@pytest.mark.slow
def test_a_killed_generator_is_named_and_leaves_no_engine_processes_behind(tmp_path):
    import time

    run = tmp_path / "run"
    proc = _launch(*SMALL, f"run.dir={run}", "ft.inject_failure=generator:0:kill@2")
    assert proc.returncode != 0
    assert "run failed in generator:0" in proc.stderr  # the killed rank, not a peer that lost it
    time.sleep(1.0)
    # vLLM's engine processes outlive a SIGKILLed parent; the rank supervisor kills them
    assert _live_processes_of(run) == []


@pytest.mark.slow
def test_a_trainer_frozen_in_its_train_step_is_named_within_the_heartbeat_timeout(tmp_path):
    """Issue 31: the refit no longer bounds the wait for a trainer's train step, so a trainer
    that freezes there (SIGSTOP: its heartbeat thread stops too) must still be found by the
    heartbeats. trainer:0 hosts the job's store: the others lose it and name it."""
    import time

    run = tmp_path / "run"
    t0 = time.monotonic()
    proc = _launch(*SMALL, f"run.dir={run}", "ft.inject_failure=trainer:0:freeze@train2", "ft.heartbeat_interval_s=0.5",
                   "ft.heartbeat_timeout_s=5", "refit.timeout_s=5")
    seconds = time.monotonic() - t0
    assert proc.returncode != 0
    assert "SIGSTOP on trainer:0 at step train2" in (run / "logs" / "trainer.0.out").read_text()
    verdict = (run / "errors" / "dead_rank.0.txt").read_text()
    assert verdict.startswith("trainer:0 (the rendezvous store host) stopped answering"), verdict
    assert "run failed in trainer:0" in proc.stderr, proc.stderr[-3000:]
    frozen_at = (run / "logs" / "trainer.0.out").stat().st_mtime  # its last line is the freeze
    named_at = (run / "errors" / "dead_rank.0.txt").stat().st_mtime
    # the peers' store calls time out after max(ft.heartbeat_timeout_s, 5 s); a beat of slack
    assert named_at - frozen_at < 5.0 + 1.5, (named_at - frozen_at, verdict)
    assert seconds < 300

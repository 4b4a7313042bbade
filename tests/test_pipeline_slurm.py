"""tiny_pipeline end to end on the local Slurm cluster, short (a few steps per stage): one
teacher is killed past its retry budget (the suite's check of an exhausted budget in a
Slurm job), MOPD is cancelled naming it, and running the command again finishes the
pipeline without rerunning the stages that finished.

One pipeline run serves both tests (module fixture): the failure half, then the resume half."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from hpc_rl.pipeline.state import PipelineRecord
from hpc_rl.pipeline.submit import wait

# 3 steps of 16 samples per stage (the kill at step 3 finds the step-2 checkpoint and the
# resume still has a step to compute), a checkpoint every 2 steps, no evaluation
SHORT = ["run.max_steps=3", "algo.prompts_per_step=8", "algo.generations_per_prompt=2", "trainer.global_batch_size=16",
         "data.samples_per_task=16", "data.eval_prompts_per_task=0", "checkpoint.every_steps=2",
         "launcher.slurm.signal_grace_s=60"]
# teacher_add's trainer is SIGKILLed at step 3 (after the step-2 checkpoint), no retry allowed
KILL = ["stages.teacher_add.ft.inject_failure=trainer:0:kill@3", "stages.teacher_add.ft.max_restarts=0"]


def _launch(pdir, extra=()):
    cmd = [sys.executable, "-m", "hpc_rl.launch", "+pipeline=tiny_pipeline", f"pipeline.dir={pdir}", *SHORT, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _steps(run_dir) -> int:
    p = run_dir / "metrics.jsonl"
    return sum(1 for line in p.read_text().splitlines() if '"kind": "step"' in line) if p.exists() else 0


@pytest.fixture(scope="module")
def failed(local_slurm, tmp_path_factory):
    pdir = tmp_path_factory.mktemp("pipeline") / "tiny"
    t0 = time.monotonic()
    out = _launch(pdir, KILL)
    rec = wait(pdir, timeout_s=1200)
    return pdir, rec, out, time.monotonic() - t0


@pytest.mark.slurm
@pytest.mark.slow
def test_a_teacher_failing_past_its_retry_budget_cancels_mopd_with_the_reason(failed):
    pdir, rec, out, _ = failed
    assert "--dependency=afterok:" in out  # the teachers wait for rlvr, mopd for all three
    states = {n: s.state for n, s in rec.stages.items()}
    assert states == {"rlvr": "COMPLETED", "teacher_add": "FAILED", "teacher_mul": "COMPLETED", "mopd": "CANCELLED"}, \
        {n: (s.state, s.reason) for n, s in rec.stages.items()}
    assert "retry budget exhausted after 0 restarts (ft.max_restarts=0)" in rec.stages["teacher_add"].reason
    # the exhausted retry budget, as the batch shell recorded it in the stage's run directory:
    # no requeue, the killed role named, no resume, no summary, not finished (this stage is the
    # suite's one Slurm job that exhausts its budget; test_chaos_slurm's drills all recover)
    teacher = pdir / "teacher_add"
    job_exit = json.loads((teacher / "job_exit.json").read_text())
    assert job_exit["requeued"] is False and job_exit["failed_role"] == "trainer" and job_exit["exit_code"] != 0, job_exit
    assert str(job_exit["job_id"]) == str(rec.stages["teacher_add"].job_id)
    assert "retry budget exhausted after 0 restarts (ft.max_restarts=0)" in job_exit["detail"]
    assert not (teacher / "restarts.jsonl").exists() and not (teacher / "summary.json").exists()
    assert not (teacher / "FINISHED").exists()
    assert rec.stages["mopd"].reason.startswith("upstream stage teacher_add failed")
    assert not (pdir / "mopd" / "metrics.jsonl").exists()  # it never started
    status = subprocess.run([sys.executable, "-m", "hpc_rl.pipeline", "status", str(pdir)], capture_output=True, text=True)
    assert "DAG: rlvr  ->  {teacher_add, teacher_mul}  ->  mopd" in status.stdout
    assert "why: upstream stage teacher_add failed" in status.stdout


@pytest.mark.slurm
@pytest.mark.slow
def test_rerunning_the_command_resumes_the_failed_stage_and_finishes_without_rerunning_the_others(failed):
    pdir, before, _, _ = failed
    kept = {n: (before.stages[n].job_id, _steps(pdir / n)) for n in ("rlvr", "teacher_mul")}
    out = _launch(pdir)  # the same command, without the injected failure
    assert all(f"  {name:<20} finished: skipped" in out for name in ("rlvr", "teacher_mul")), out
    rec = wait(pdir, timeout_s=1200)
    assert all(s.state == "COMPLETED" for s in rec.stages.values()), {n: (s.state, s.reason) for n, s in rec.stages.items()}
    # the finished stages were neither resubmitted nor recomputed
    assert {n: (rec.stages[n].job_id, _steps(pdir / n)) for n in kept} == kept
    assert len(rec.stages["rlvr"].jobs) == 1 and len(rec.stages["teacher_add"].jobs) == 2 and len(rec.stages["mopd"].jobs) == 2
    # teacher_add resumed from its step-2 checkpoint in its own run directory
    resumes = [json.loads(line) for line in (pdir / "teacher_add" / "restarts.jsonl").read_text().splitlines()]
    assert resumes and resumes[-1]["resumed_from_step"] == 2, resumes
    assert (pdir / "teacher_add" / "attempts" / before.stages["teacher_add"].job_id / "job_exit.json").exists()
    summary = json.loads((pdir / "mopd" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["model"] and (pdir / "mopd" / "final_hf" / "config.json").exists()
    mopd_cfg = (pdir / "mopd" / "config.yaml").read_text()
    assert str(pdir / "teacher_add" / "final_hf") in mopd_cfg and str(pdir / "rlvr" / "final_hf") in mopd_cfg
    assert PipelineRecord.load(pdir).stages["mopd"].state == "COMPLETED"

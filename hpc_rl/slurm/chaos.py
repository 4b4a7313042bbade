"""Chaos drills: interrupt a real run on a Slurm cluster and check it finishes as if
nothing happened. Used by the chaos tests and `bench/faults.py` on the local cluster.

Slurm holds a requeued job for about two minutes (BeginTime); on a test cluster
`release=True` lets it start at once (`scontrol update JobId=N StartTime=now`), which a
real cluster's policy would not allow from user space.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from hpc_rl.rundir import RunDir

from .executor import job_from_run_dir


RELEASE_AFTER_S = 5.0


@dataclass
class DrillResult:
    state: str  # the job's final state as squeue/sacct/job_exit.json say
    seconds: float
    job_id: str
    restarts: List[dict] = field(default_factory=list)  # restarts.jsonl of the run
    job_exit: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    events: dict = field(default_factory=dict)  # what the drill measured (seconds, steps)

    @property
    def finished(self) -> bool:
        return self.state == "COMPLETED" and bool(self.summary)


def launch(run_dir: Path, overrides: Sequence[str], env: Optional[dict] = None) -> str:
    """Submit (launcher=slurm, not waiting); returns the job id."""
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", *overrides, "launcher=slurm", "launcher.wait=false",
                           f"run.dir={run_dir}"], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return job_from_run_dir(run_dir).job_id


def squeue_state(job_id: str) -> Optional[tuple]:
    """(state, reason) of the job, or None when Slurm no longer lists it. A requeued het
    job shows BeginTime on one component and Resources on the others: any BeginTime wins."""
    lines = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True).stdout.splitlines()
    rows = [(ln.split() + [""])[:2] for ln in lines if ln.strip()]
    if not rows:
        return None
    held = [r for r in rows if r[0] == "PENDING" and r[1] == "BeginTime"]
    return tuple(held[0] if held else rows[0])


def steps_done(run_dir: Path) -> int:
    p = RunDir(run_dir).metrics
    if not p.exists():
        return 0
    return sum(1 for line in p.read_text().splitlines() if '"kind": "step"' in line)


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.5,
             explain: Optional[Callable[[], str]] = None) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}" + (f"\n{explain()}" if explain else ""))
        time.sleep(poll_s)
    return time.monotonic() - t0


def follow(run_dir: Path, job_id: str, timeout_s: float = 900, release: bool = True,
           until: Optional[Callable[[], bool]] = None) -> str:
    """Until the job leaves the queue for good, or until `until()` holds ("UNTIL": the job
    goes on); releases requeue holds on the way."""
    t0 = time.monotonic()
    held_since: Optional[float] = None
    while time.monotonic() - t0 < timeout_s:
        if until is not None and until():
            return "UNTIL"
        st = squeue_state(job_id)
        if st is None:
            exit_path = RunDir(run_dir).job_exit
            if exit_path.exists():
                ex = json.loads(exit_path.read_text())
                if not ex.get("requeued"):
                    return "COMPLETED" if ex.get("exit_code") == 0 else "FAILED"
            time.sleep(1.0)  # between the requeue and the job being listed again
            continue
        state, reason = st
        if state == "PENDING" and reason == "BeginTime":
            held_since = held_since or time.monotonic()
            # Not at once: a job started within a second of its requeue can find the old
            # instance's credential still being revoked on the node and die at start-up
            # ("Job credential revoked"); Slurm's own hold exists for that cleanup.
            if release and time.monotonic() - held_since >= RELEASE_AFTER_S:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
        else:
            held_since = None
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} still in the queue after {timeout_s:.0f}s\n{explain(run_dir, job_id)}")


def result(run_dir: Path, job_id: str, state: str, t0: float, events: Optional[dict] = None) -> DrillResult:
    rd = RunDir(run_dir)
    restarts = [json.loads(x) for x in rd.restarts.read_text().splitlines()] if rd.restarts.exists() else []
    job_exit = json.loads(rd.job_exit.read_text()) if rd.job_exit.exists() else {}
    summary = json.loads(rd.summary.read_text()) if rd.summary.exists() else {}
    return DrillResult(state, time.monotonic() - t0, job_id, restarts, job_exit, summary, events or {})


def uninterrupted(run_dir: Path, overrides: Sequence[str], timeout_s: float = 900) -> DrillResult:
    t0 = time.monotonic()
    job = launch(run_dir, overrides)
    return result(run_dir, job, follow(run_dir, job, timeout_s), t0)


# A step of the tiny drills takes about a second here, so a signal sent once N steps are
# recorded could land after the run has finished. Trainer rank 0 therefore stalls at the
# start of step N+1 (after that step's stop check): the interruption always lands inside it.
# The USR1 drill releases the stall as soon as the batch shell has recorded the signal, and a
# requeue ends it, so the bound only matters on a machine too loaded to do either sooner.
STALL_S = 60


def stalled(after_steps: int) -> str:
    """The injection that holds trainer rank 0 at the start of step `after_steps` + 1."""
    return f"trainer:0:stall{STALL_S}@{after_steps + 1}"


def stalled_after(overrides: Sequence[str], after_steps: int, later: Sequence[str] = ()) -> List[str]:
    """`overrides` with the stall injected, and the injections `later` beside it."""
    return [*overrides, "ft.inject_failure=" + "+".join([stalled(after_steps), *later])]


def launch_stalled(run_dir: Path, overrides: Sequence[str], after_steps: int, timeout_s: float,
                   later: Sequence[str] = ()) -> str:
    """Submit with the stall (and `later`) injected; returns the job id once `after_steps`
    steps are recorded (the next step is then stalled)."""
    job = launch(run_dir, stalled_after(overrides, after_steps, later))
    wait_for(lambda: steps_done(run_dir) >= after_steps, timeout_s, f"{after_steps} steps",
             explain=lambda: explain(run_dir, job))
    return job


def usr1_mid_run(run_dir: Path, overrides: Sequence[str], after_steps: int, timeout_s: float = 900) -> DrillResult:
    """USR1 to the batch shell (what Slurm sends before the time limit) once `after_steps`
    steps are done: the ranks save after the next step and stop, the job requeues itself
    and resumes."""
    t0 = time.monotonic()
    job = launch_stalled(run_dir, overrides, after_steps, timeout_s)
    events = _usr1(run_dir, job)
    return result(run_dir, job, follow(run_dir, job, timeout_s), t0, events)


def usr1_then(run_dir: Path, overrides: Sequence[str], after_steps: int, requeue_after: Optional[int] = None,
              inject: Optional[str] = None, timeout_s: float = 900) -> DrillResult:
    """Two interruptions of one job, one per attempt (a drill's time is mostly its job's
    start-up, so the drills share jobs): USR1 on attempt 0 as `usr1_mid_run`, then on
    attempt 1 `scontrol requeue` from outside once `requeue_after` steps are done (inside
    the next, stalled: as `external_requeue`) and/or the injection `inject` (e.g.
    "generator:0:kill@6"), which fires on attempt 1."""
    t0 = time.monotonic()
    later = ([stalled(requeue_after)] if requeue_after is not None else []) + ([inject] if inject else [])
    job = launch_stalled(run_dir, overrides, after_steps, timeout_s, later=[f"{x}/restart1" for x in later])
    events = _usr1(run_dir, job)
    # attempt 0 has stopped: attempt 1's stall must hold until its own interruption
    RunDir(run_dir).stall_release.unlink(missing_ok=True)
    if requeue_after is not None:
        state = follow(run_dir, job, timeout_s, until=lambda: steps_done(run_dir) >= requeue_after)
        if state != "UNTIL":  # attempt 1 ended before the requeue was due: the drill says how
            return result(run_dir, job, state, t0, events)
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True)
        events["requeued_after_steps"] = steps_done(run_dir)
    return result(run_dir, job, follow(run_dir, job, timeout_s), t0, events)


def _usr1(run_dir: Path, job: str) -> dict:
    """USR1 to the batch shell of `job` (its trainer:0 stalled inside a step); returns once
    the ranks have saved and stopped, with what was measured."""
    t_sig = time.time()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, capture_output=True)
    rd = RunDir(run_dir)
    # the batch shell's trap has written the save request: the ranks will see it once the
    # stalled step ends, so the stall has served and is released (runtime/faults.py)
    wait_for(rd.save_request(0).exists, 120, "the batch shell's save request", explain=lambda: explain(run_dir, job))
    rd.stall_release.touch()
    stopped = rd.stopped(0)
    wait_for(stopped.exists, 300, "the ranks to save and stop", explain=lambda: explain(run_dir, job))
    saved = json.loads(stopped.read_text())
    # signal -> checkpoint includes the rest of the (stalled) step; the save alone is save_s
    return {"usr1_to_checkpoint_s": saved["time"] - t_sig, "save_s": saved.get("save_s"),
            "stopped_after_step": saved["step"], "checkpoint_saved": saved["saved"], "stall_s": STALL_S}


def external_requeue(run_dir: Path, overrides: Sequence[str], after_steps: int, timeout_s: float = 900) -> DrillResult:
    """`scontrol requeue` from outside once `after_steps` steps are done (inside the next)."""
    t0 = time.monotonic()
    job = launch_stalled(run_dir, overrides, after_steps, timeout_s)
    subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True)
    events = {"requeued_after_steps": steps_done(run_dir), "stall_s": STALL_S}
    return result(run_dir, job, follow(run_dir, job, timeout_s), t0, events)


def explain(run_dir: Path, job_id: str) -> str:
    """What a drill that timed out saw: the job's state and the run's own records."""
    rd = RunDir(run_dir)
    lines = [f"job {job_id}: {squeue_state(job_id) or 'no longer listed'}; {steps_done(run_dir)} steps recorded"]
    for p in (rd.restarts, rd.job_exit, rd.batch_log):
        if p.exists():
            lines.append(f"{p.relative_to(rd.path)}: {p.read_text()[-1500:].strip()}")
    for p in sorted(rd.errors.glob("*.txt")):  # none when the directory is absent
        lines.append(f"{p.relative_to(rd.path)}: {p.read_text()[:500].strip()}")
    return "\n".join(lines)

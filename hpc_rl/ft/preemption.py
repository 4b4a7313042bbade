"""Preemption and time limits: the batch shell's USR1 trap touches a save-request file;
the driver polls it between steps, the ranks save and stop, and the driver leaves a
`stopped` file so the batch shell requeues instead of failing the job."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from hpc_rl.rundir import RunDir


def save_requested(run_dir: Path, restart: int) -> Optional[str]:
    """The reason the batch shell wrote (Slurm sent USR1: the time limit is near), or None."""
    req = RunDir(run_dir).save_request(restart)
    return (req.read_text().strip() or "save requested") if req.exists() else None


def save_fits(job_end: Optional[str], now: float, margin_s: float, last_save_s: Optional[float],
              first_guess_s: float = 10.0) -> bool:
    """Whether a checkpoint save started `now` ends `margin_s` before the job's end (epoch
    seconds from the batch shell; unknown: always). The estimate is 1.5x the last save, or
    `first_guess_s` before the first: a save cut by the time limit is worse than none."""
    if not job_end:
        return True
    estimate = 1.5 * (last_save_s if last_save_s is not None else first_guess_s)
    return float(job_end) - now - margin_s > estimate


def write_stopped(run_dir: Path, restart: int, step: int, saved: bool, requested_at: float) -> float:
    """Record that the run stopped after `step` for a requeue; returns the seconds since
    the request was seen (the save's share of the grace period)."""
    now = time.time()
    RunDir(run_dir).stopped(restart).write_text(
        json.dumps({"step": step, "saved": saved, "time": now, "save_s": now - requested_at}) + "\n")
    return now - requested_at

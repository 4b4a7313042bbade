"""Follow or cancel a run: `python -m hpc_rl.slurm.watch RUN_DIR [--once] [--steps N] [--poll S] [--cancel]`.

Shows the job's state and the live view of hpc_rl/observe/live.py: what every role is doing
now, key metrics and the slowest rank of each role for the last steps. It redraws on a
terminal and prints a snapshot per finished step otherwise; `--once` prints one and exits.

Where the state comes from: a `launcher=slurm` run has job.json, so Slurm's states of each
component (sacct or squeue, then the batch shell's exit record). A `launcher=local` run, or
a hand-submitted script, has no job handle to ask: its state is what the run directory
records (FINISHED, error reports, a stop for a requeue, job_exit.json). Either way nothing
but the run directory and, for Slurm runs, the Slurm commands is needed.

`follow` (used by `launcher.wait=true`) prints one line per change of any component's state.
A job that no source lists for a while (UNKNOWN) is followed on while its run directory
changes. Reattaching checks that Slurm's job of the recorded id is still this run's (ids
come back after a controller restart): `--cancel` refuses another job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from hpc_rl.observe.live import COMPLETED, DEFAULT_STEPS, FAILED, STOPPED, file_state, last_step, render
from hpc_rl.rl.records import render_summary
from hpc_rl.rundir import RunDir

from .executor import TERMINAL_BAD, HetJob, job_from_run_dir

TERMINAL = ("COMPLETED", *TERMINAL_BAD)
FILE_TERMINAL = (COMPLETED, FAILED, STOPPED)


def status_line(job: HetJob, states: Dict[str, str], t0: float) -> str:
    cells = "  ".join(f"{role}={states.get(role, '?')}" for role in job.roles)
    return f"[{time.monotonic() - t0:6.1f}s] job {job.job_id} ({job.source}): {cells}"


def last_activity(run_dir: Optional[Path], depth: int = 2) -> Optional[float]:
    """The newest modification time of anything in the run directory (logs, timing, heartbeats,
    records, checkpoints), `depth` levels down: a running job writes there."""
    if run_dir is None:
        return None
    newest: Optional[float] = None
    stack = [(Path(run_dir), 0)]
    while stack:
        path, level = stack.pop()
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        for entry in entries:
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue
            newest = mtime if newest is None else max(newest, mtime)
            if level < depth and entry.is_dir(follow_symlinks=False):
                stack.append((Path(entry.path), level + 1))
    return newest


class LostJudge:
    """UNKNOWN (no source lists the job) is reported, not fatal: a loaded slurmdbd or a slow
    controller can hide a healthy job for a while. The job counts as lost only when it has read
    UNKNOWN for `lost_after_s` and its run directory has not changed for as long."""

    def __init__(self, run_dir: Optional[Path], lost_after_s: float) -> None:
        self.run_dir, self.lost_after_s = run_dir, lost_after_s
        self.since: Optional[float] = None

    def lost(self, overall: str) -> bool:
        if overall != "UNKNOWN":
            self.since = None
            return False
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        if now - self.since <= self.lost_after_s:
            return False
        active = last_activity(self.run_dir)
        return active is None or time.time() - active > self.lost_after_s

    def note(self) -> str:
        """What a status line adds while the state is UNKNOWN."""
        if self.since is None:
            return ""
        active = last_activity(self.run_dir)
        ago = f"run directory written {time.time() - active:.0f}s ago" if active is not None else "no run directory yet"
        return f"  [UNKNOWN for {time.monotonic() - self.since:.0f}s: no source lists the job; {ago}; still following]"


def follow(job: HetJob, poll_s: float = 2.0, timeout_s: Optional[float] = None, echo: Callable[[str], None] = print,
           lost_after_s: float = 60.0) -> str:
    """Block until the job ends, printing per-role states as they change; returns the final
    state. A job no source lists (UNKNOWN) is followed on while its run directory changes;
    it counts as lost after `lost_after_s` of both (LostJudge)."""
    t0 = time.monotonic()
    last = None
    judge = LostJudge(job.run_dir, lost_after_s)
    last_note = -1.0
    while True:
        states = job.component_states(force=True)
        overall = job.watcher.get_state(job.job_id, mode="cache")
        lost = judge.lost(overall)
        if (states, overall) != last:
            echo(status_line(job, states, t0))
            last = (states, overall)
        elif overall == "UNKNOWN" and time.monotonic() - last_note >= max(10.0, poll_s):
            echo(status_line(job, states, t0) + judge.note())  # say it, every 10 s at most
            last_note = time.monotonic()
        if overall in TERMINAL or lost:
            return overall
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"job {job.job_id} still {overall} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def summarize(job: HetJob) -> str:
    lines = []
    for role, rows in job.role_outcomes().items():
        ok = sum(1 for o, _ in rows if o == "success")
        lines.append(f"  {role:<20} {ok}/{len(rows)} ranks succeeded")
    failure = job.failure()
    if failure:
        lines.append(f"  failure: {failure}")
    return "\n".join(lines)


def job_state(job: Optional[HetJob], run_dir: Path) -> Tuple[str, str, bool]:
    """(overall state, the view's state line, whether it is final)."""
    if job is None:
        state, detail = file_state(run_dir)
        return state, f"{state} (no Slurm job: state from the run directory)" + (f": {detail}" if detail else ""), \
            state in FILE_TERMINAL
    states = job.component_states(force=True)
    overall = job.watcher.get_state(job.job_id, mode="cache")
    cells = "  ".join(f"{role}={states.get(role, '?')}" for role in job.roles)
    failed = job.failed_role() if overall in TERMINAL_BAD else None
    other = job.watcher.get_info(job.job_id, mode="cache").get("other_job")
    line = f"job {job.job_id} {overall} ({job.source}): {cells}" + (f"  failed role: {failed}" if failed else "")
    return overall, line + (f"\n  note: {other}" if other else ""), overall in TERMINAL


def watch(run_dir: Path, once: bool = False, steps: int = DEFAULT_STEPS, poll_s: float = 2.0,
          echo: Callable[[str], None] = print, lost_after_s: float = 60.0) -> str:
    """Show the live view until the run ends (or once); returns the last overall state."""
    job = job_from_run_dir(run_dir) if RunDir(run_dir).job_meta.exists() else None
    tty = sys.stdout.isatty() and echo is print
    last_key = None
    judge = LostJudge(run_dir, lost_after_s)
    while True:
        overall, line, final = job_state(job, run_dir)
        view = render(run_dir, line, steps)
        if once:
            echo(view)
            return overall
        # a terminal gets a redrawn screen; a file or pipe a snapshot per state or step change
        key = view if tty else (line, last_step(run_dir))
        if key != last_key:
            echo(("\x1b[H\x1b[2J" if tty else "") + view + ("" if tty else "\n"))
            last_key = key
        if judge.lost(overall):  # no source lists it, and the run directory stopped changing
            final = True
        if final:
            if job is not None:
                echo(f"job {job.job_id} {overall}\n{summarize(job)}")
            summary = RunDir(run_dir).summary
            if summary.exists():  # the driver's end-of-run summary, slowest ranks included
                echo(render_summary(json.loads(summary.read_text())))
            return overall
        time.sleep(poll_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpc_rl.slurm.watch", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--once", action="store_true", help="print one snapshot and exit")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="how many recent steps to show")
    ap.add_argument("--poll", type=float, default=2.0, help="seconds between refreshes")
    ap.add_argument("--cancel", action="store_true", help="cancel the run's Slurm job")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not (args.run_dir / RunDir.CONFIG).exists():
        print(f"{args.run_dir}: not a run directory (no {RunDir.CONFIG})", file=sys.stderr)
        return 2
    if args.cancel:
        if not RunDir(args.run_dir).job_meta.exists():
            print(f"{args.run_dir} has no Slurm job (launcher=local?): stop its launcher instead (Ctrl-C)",
                  file=sys.stderr)
            return 2
        job = job_from_run_dir(args.run_dir)
        same, why = job.check_identity()
        if same is False:  # never scancel someone else's job that got this run's old id
            print(f"{args.run_dir}: job {job.job_id} is not this run's job any more ({why}); not cancelled", file=sys.stderr)
            return 1
        job.cancel()
        print(f"cancelled job {job.job_id}")
        return 0
    if RunDir(args.run_dir).job_meta.exists():
        same, why = job_from_run_dir(args.run_dir).check_identity()
        if same is not True:
            print(("not this run's job: " if same is False else "cannot tell whether this is the run's job: ") + why, file=sys.stderr)
    state = watch(args.run_dir, once=args.once, steps=args.steps, poll_s=args.poll)
    return 0 if args.once or state == COMPLETED else 1


if __name__ == "__main__":
    sys.exit(main())

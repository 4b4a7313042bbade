"""Follow or cancel a submitted run: `python -m hpc_rl.slurm.watch RUN_DIR [--cancel]`.

Prints one line per change of any component's state, then the outcome per role.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Dict, Optional

from .executor import TERMINAL_BAD, HetJob, job_from_run_dir

TERMINAL = ("COMPLETED", *TERMINAL_BAD)


def status_line(job: HetJob, states: Dict[str, str], t0: float) -> str:
    cells = "  ".join(f"{role}={states.get(role, '?')}" for role in job.roles)
    return f"[{time.monotonic() - t0:6.1f}s] job {job.job_id} ({job.watcher.source}): {cells}"


def follow(job: HetJob, poll_s: float = 2.0, timeout_s: Optional[float] = None, echo: Callable[[str], None] = print,
           lost_after_s: float = 60.0) -> str:
    """Block until the job ends, printing per-role states as they change; returns the final
    state. A job Slurm no longer lists and that left no exit record counts as lost
    (UNKNOWN) after `lost_after_s`."""
    t0 = time.monotonic()
    last = None
    unknown_since: Optional[float] = None
    while True:
        states = job.component_states(force=True)
        overall = job.watcher.get_state(job.job_id, mode="cache")
        if (states, overall) != last:
            echo(status_line(job, states, t0))
            last = (states, overall)
        if overall in TERMINAL:
            return overall
        if overall == "UNKNOWN":
            unknown_since = unknown_since or time.monotonic()
            if time.monotonic() - unknown_since > lost_after_s:
                return overall
        else:
            unknown_since = None
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


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        print("usage: python -m hpc_rl.slurm.watch RUN_DIR [--cancel]", file=sys.stderr)
        return 2
    job = job_from_run_dir(Path(args[0]))
    if "--cancel" in args:
        job.cancel()
        print(f"cancelled job {job.job_id}")
        return 0
    state = follow(job)
    print(f"job {job.job_id} {state}\n{summarize(job)}")
    return 0 if state == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())

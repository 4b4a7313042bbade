"""Each rank runs under a small supervisor that cleans up after it, however it ends.

vLLM's engine processes (EngineCore, workers) outlive a generator rank killed with
SIGKILL: they are reparented to init, keep gigabytes of memory, and Slurm's linuxproc
process tracking loses them, so the requeued job's engine can no longer start on that node
("Available memory ... is less than desired"). The supervisor starts the rank as its child
in the same process group, forwards signals to it, and when it exits kills whatever is
left in the group: the child's orphans included. It returns the child's exit status
(128 + signal for a killed child, as a shell reports it).

Only the supervisor sees the signal that ended the rank, so it is the one to say so: a child
killed by a signal it did not forward (the OOM killer, an injected or a person's kill) leaves
the rank's error report in its words (runtime/death.py), which the local launcher and the batch
shell's job_exit.json quote; a signal it forwarded was a stop its sender already knows of.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from .death import OomWatch, explain
from .env import SUPERVISED as MARK  # set to 1 in the child, so it runs the rank instead of supervising


def is_child() -> bool:
    return os.environ.get(MARK) == "1"


def group_members(pgid: int) -> List[int]:
    """PIDs in process group `pgid` other than this process (Linux /proc)."""
    me, out = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            out.append(int(d.name))
    return out


def descendants(pid: int) -> List[int]:
    """PIDs of `pid`'s children, their children and so on (Linux /proc), deepest last."""
    children: dict = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        out.extend(kids)
        todo.extend(kids)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything below it (children first read, then all killed)."""
    for p in [*descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def exit_now(rc: int) -> None:
    """Leave the supervised rank once its outcome is recorded, without the interpreter's
    teardown: freeing torch, transformers and vLLM's modules took 3-5 s per rank on two
    loaded cores (py-spy: every rank busy in finalization after its result was written),
    and the launcher waits for the slowest. What must outlive the rank is written or closed
    before (result pickle, loggers, checkpoints, the engine); the supervisor kills what is
    left of its process group."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


def _who() -> Optional[Tuple[str, object, int]]:
    """(role, rank, restart) the launcher gave this rank, or None when its variables are unusable."""
    from .env import RankEnv

    try:
        ident = RankEnv.from_env()
    except ValueError:
        return None
    return ident.role or "unknown", "?" if ident.role_rank is None else ident.role_rank, ident.restart or 0


def record_death(run_dir: str, text: str) -> None:
    """The rank's error report (errors/<role>.<rank>.<restart>.txt, as results.py writes it),
    unless the rank wrote its own before it died: its traceback then says more."""
    from hpc_rl.rundir import RunDir

    who = _who()
    if who is None:
        return
    role, rank, restart = who
    path = RunDir(Path(run_dir)).error_report(role, rank, restart)
    if path.exists():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{role}:{rank}: {text}\n")
    except OSError:
        pass  # an unwritable run directory: the supervisor's stderr line still says it


def supervise(module: str, args: List[str], run_dir: Optional[str] = None) -> int:
    # Clean up only a group of our own: lead one (srun tasks and local-launcher ranks already
    # do; a rank started from a shell or a test would otherwise share, and kill, its caller's).
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)
    env = dict(os.environ, **{MARK: "1"})
    watch = OomWatch()  # before the child runs: a kill during it shows as a rise
    forwarded = set()
    child = subprocess.Popen([sys.executable, "-m", module, *args], env=env)

    def forward(signum, _frame):
        forwarded.add(signum)
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    rc: Optional[int] = None
    while rc is None:
        try:
            rc = child.wait()
        except InterruptedError:
            continue
    if rc < 0:  # Popen's word for a death by signal -rc
        text = explain(rc, child.pid, watch)
        who = _who()
        print(f"hpc_rl: {f'{who[0]}:{who[1]}' if who else 'the rank'} {text}", file=sys.stderr, flush=True)
        if run_dir and -rc not in forwarded:
            record_death(run_dir, text)
    leftovers = group_members(os.getpgid(0))
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if leftovers:
        print(f"hpc_rl: supervisor killed {len(leftovers)} leftover process(es) of the rank (pids {leftovers[:8]})",
              file=sys.stderr, flush=True)
    return rc if rc >= 0 else 128 - rc

"""`launcher=local`: every role's ranks as processes on this machine, through the same
worker entry and environment contract as Slurm tasks (HPC_RL_ROLE, ranks, store address).

The launcher is the supervisor: when any rank exits non-zero it stops all others (each
rank runs in its own session so its children die with it; no orphans), and its exit
code says which role failed: 10 + the role's component index.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, List, Optional

from hpc_rl.plan.job_plan import JobPlan, error_report_path, role_file_name

FAILED_ROLE_EXIT_BASE = 10


@dataclass
class Rank:
    role: str
    component: int
    role_rank: int
    proc: subprocess.Popen
    logs: List[IO]


@dataclass
class LocalOutcome:
    exit_code: int
    failed: Optional[str]  # "role:rank" of the first failure
    detail: str
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(ranks: List[Rank], grace_s: float) -> None:
    live = [r for r in ranks if r.proc.poll() is None]
    for r in live:
        try:
            os.killpg(r.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(r.proc.poll() is None for r in live):
        time.sleep(0.1)
    for r in live:
        if r.proc.poll() is None:
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            r.proc.wait()


def _error_line(run_dir: Path, role: str, rank: int) -> str:
    path = error_report_path(run_dir, role, rank, 0)
    if path.exists():
        return path.read_text().splitlines()[0]
    dead = run_dir / "errors" / "dead_rank.0.txt"  # heartbeats named a dead or frozen rank
    if dead.exists():
        return dead.read_text().splitlines()[0]
    return f"{role}:{rank}: no error recorded (killed?)"


def culprit(bad: List[Rank]) -> Rank:
    """Among failed ranks: one killed by a signal, before one that raised (often a
    'connection reset' from losing that peer), before one that stopped on a heartbeat
    verdict (exit 75)."""
    from hpc_rl.runtime.heartbeat import ABORT_EXIT_CODE

    def score(r: Rank) -> int:
        rc = r.proc.returncode
        killed = rc < 0 or rc >= 128  # a signal (the rank supervisor reports 128 + signal)
        return 3 if killed else 1 if rc == ABORT_EXIT_CODE else 2
    return max(bad, key=score)  # max keeps the first of equals: rank order


class ProgressDisplay:
    """The run's progress.json (written by trainer rank 0) as one updating line on a
    terminal, or one line per change of step when the output is a file."""

    def __init__(self, run_dir: Path, echo):
        self.run_dir, self.echo, self.last, self.open = run_dir, echo, None, False
        self.tty = sys.stdout.isatty()
        self.next_poll = 0.0

    def poll(self) -> None:
        from hpc_rl.rl.records import progress_line, read_progress

        if time.monotonic() < self.next_poll:
            return
        self.next_poll = time.monotonic() + 1.0
        p = read_progress(self.run_dir)
        if not p:
            return
        line = progress_line(p)
        key = line if self.tty else (p.get("step"), p.get("phase") if str(p.get("phase", "")).startswith("eval") else "")
        if key == self.last:
            return
        self.last = key
        if self.tty:
            sys.stdout.write("\r" + line)
            sys.stdout.flush()
            self.open = True
        else:
            self.echo(line)

    def close(self) -> None:
        if self.open:
            sys.stdout.write("\n")
            self.open = False


def launch_local(plan: JobPlan, run_dir: Path, grace_s: float = 10.0, echo=print) -> LocalOutcome:
    run_dir = Path(run_dir)
    logs_dir = run_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    base = dict(os.environ)
    base.update({
        "HPC_RL_RUN_DIR": str(run_dir),
        "HPC_RL_JOB_ID": f"local-{os.getpid()}",
        "HPC_RL_RESTART": "0",
        "HPC_RL_MASTER_ADDR": "127.0.0.1",
        "HPC_RL_MASTER_PORT": str(free_port()),
        "PYTHONUNBUFFERED": "1",
    })
    ranks: List[Rank] = []
    t0 = time.perf_counter()

    def on_signal(signum, _frame):
        _stop(ranks, grace_s)
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for k, role in enumerate(plan.roles):
            log = role_file_name(role.name)
            out = open(logs_dir / f"{log}.0.out", "a")
            err = open(logs_dir / f"{log}.0.err", "a")
            for node in range(role.nodes):
                for local in range(role.tasks_per_node):
                    rank = node * role.tasks_per_node + local
                    env = dict(base, HPC_RL_ROLE=role.name, HPC_RL_ROLE_RANK=str(rank), HPC_RL_ROLE_SIZE=str(role.tasks),
                               HPC_RL_LOCAL_RANK=str(local), HPC_RL_NODE=f"local{node}")
                    proc = subprocess.Popen([sys.executable, "-m", "hpc_rl.runtime.worker", str(run_dir)], env=env,
                                            stdout=out, stderr=err, start_new_session=True)
                    ranks.append(Rank(role.name, k, rank, proc, [out, err]))
        echo(f"[local] started {len(ranks)} ranks: " + ", ".join(f"{r.name} x{r.tasks}" for r in plan.roles)
             + f"; logs in {logs_dir}")
        failed: Optional[Rank] = None
        shown = ProgressDisplay(run_dir, echo)
        first_bad: Optional[float] = None
        while any(r.proc.poll() is None for r in ranks):
            shown.poll()
            bad = [r for r in ranks if r.proc.poll() not in (None, 0)]
            if bad and first_bad is None:
                first_bad = time.monotonic()
            # a moment for the peers of a dead rank to fail too, so the culprit can be told apart
            if bad and time.monotonic() - first_bad >= 2.0:
                failed = culprit(bad)
                break
            time.sleep(0.1)
        shown.close()
        if failed is None:
            bad = [r for r in ranks if r.proc.returncode != 0]
            failed = culprit(bad) if bad else None
        if failed is not None:
            echo(f"[local] {failed.role}:{failed.role_rank} exited {failed.proc.returncode}; stopping the other ranks")
            _stop(ranks, grace_s)
            detail = _error_line(run_dir, failed.role, failed.role_rank)
            return LocalOutcome(FAILED_ROLE_EXIT_BASE + failed.component, f"{failed.role}:{failed.role_rank}", detail,
                                time.perf_counter() - t0)
        return LocalOutcome(0, None, "", time.perf_counter() - t0)
    finally:
        _stop(ranks, grace_s)
        for r in ranks:
            for f in r.logs:
                f.close()
        for s, h in previous.items():
            signal.signal(s, h)

"""`launcher=local`: every role's ranks as processes on this machine, through the same
worker entry and environment contract as Slurm tasks (RankEnv: role, ranks, store address).

The launcher is the supervisor: when any rank exits non-zero it stops all others (each
rank runs in its own session so its children die with it; no orphans), names the most
likely culprit by the scoring table of hpc_rl/ft/culprit.py, and its exit code says which
role failed: 10 + the role's component index.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, List, Optional, Sequence

from hpc_rl.config.schema import RunConfig
from hpc_rl.ft import culprit as scoring
from hpc_rl.plan.job_plan import JobPlan
from hpc_rl.plan.report import describe
from hpc_rl.rundir import RunDir
from hpc_rl.runtime import env as env_names
from hpc_rl.runtime.death import describe_status
from hpc_rl.runtime.env import RankEnv
from hpc_rl.runtime.signed_store import new_job_key

from .report import print_summary

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


RESTART = 0  # local runs are never requeued


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except OSError:
        return None


def _error_line(run_dir: Path, role: str, rank: int) -> str:
    rd = RunDir(run_dir)
    for path in (rd.error_report(role, rank, RESTART), rd.dead_rank(RESTART)):  # heartbeats named a dead rank
        text = _read(path)
        if text:
            return text.splitlines()[0]
    return f"{role}:{rank}: no error recorded (killed?)"


def culprit(bad: List[Rank], run_dir: Path, everyone: Sequence[Rank] = ()) -> Rank:
    """The failed rank most likely to have caused the others' failures. A heartbeat verdict
    naming a dead or frozen rank decides, as in the batch shell: that rank may even still be
    running (frozen), while its peers' exits are only consequences. Otherwise the scoring
    table of hpc_rl/ft/culprit.py judges each rank by its exit status and its own report."""
    rd = RunDir(run_dir)
    verdict = _read(rd.dead_rank(RESTART))
    named = scoring.named_in_verdict(verdict) if verdict else None
    if named is not None:
        candidates = list(everyone) or bad
        exact = [r for r in candidates if (r.role, r.role_rank) == named]
        same_role = [r for r in candidates if r.role == named[0]]  # placement may have renumbered ranks
        if exact or same_role:
            return (exact or same_role)[0]

    def score(r: Rank) -> int:
        return scoring.score(r.proc.returncode, lambda: _read(rd.error_report(r.role, r.role_rank, RESTART)))
    return max(bad, key=score)  # max keeps the first of equals: rank order


class ProgressDisplay:
    """The run's progress.json (written by trainer rank 0) as one updating line on a
    terminal, or one line per change of step when the output is a file."""

    def __init__(self, run_dir: Path, echo):
        self.run_dir, self.echo, self.last, self.open = run_dir, echo, None, False
        self.tty = sys.stdout.isatty()
        self.next_poll = 0.0

    def poll(self) -> None:
        from hpc_rl.observe.progress import progress_line, read_progress

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
    rd = RunDir(run_dir)
    logs_dir = rd.logs
    logs_dir.mkdir(parents=True, exist_ok=True)
    job = RankEnv(run_dir=str(run_dir), job_id=f"local-{os.getpid()}", restart=RESTART, master_addr="127.0.0.1",
                  master_port=free_port())
    # the job's secret (runtime/signed_store.py): a fresh one per launch, in the children's
    # environment only; never in the run directory, the plan or the logs
    base = dict(os.environ, PYTHONUNBUFFERED="1", **{env_names.JOB_KEY: new_job_key()})
    ranks: List[Rank] = []
    t0 = time.perf_counter()

    def on_signal(signum, _frame):
        _stop(ranks, grace_s)
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for k, role in enumerate(plan.roles):
            out = open(rd.log(role.name, RESTART, "out"), "a")
            err = open(rd.log(role.name, RESTART, "err"), "a")
            for node in range(role.nodes):
                for local in range(role.tasks_per_node):
                    rank = node * role.tasks_per_node + local
                    ident = dataclasses.replace(job, role=role.name, role_rank=rank, role_size=role.tasks, local_rank=local,
                                                node=f"local{node}")
                    env = dict(base, **ident.to_env())
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
                failed = culprit(bad, run_dir, ranks)
                break
            time.sleep(0.1)
        shown.close()
        if failed is None:
            bad = [r for r in ranks if r.proc.returncode != 0]
            failed = culprit(bad, run_dir, ranks) if bad else None
        if failed is not None:
            rc = failed.proc.poll()
            how = describe_status(rc) if rc is not None else "was found dead by the heartbeats (still running)"
            echo(f"[local] {failed.role}:{failed.role_rank} {how}; stopping the other ranks")
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


class LocalLauncher:
    """Every role's ranks as processes here; blocks until they end. Exit 0, or 10 + the
    failed role's component index."""

    name = "local"
    starts_ranks = True

    def preflight(self, cfg: RunConfig, plan: JobPlan) -> None:
        pass  # this machine is the cluster: nothing to ask before the run directory exists

    def launch(self, cfg: RunConfig, plan: JobPlan, run_dir: RunDir, overrides: Sequence[str] = ()) -> int:
        print(describe(cfg, plan) + "\n")
        outcome = launch_local(plan, run_dir.path, grace_s=cfg.launcher.kill_grace_s)
        if outcome.exit_code:
            print(f"hpc_rl: run failed in {outcome.failed} after {outcome.seconds:.1f}s: {outcome.detail}\n"
                  f"  logs: {run_dir.logs}", file=sys.stderr)
        else:
            print(f"[local] all ranks finished in {outcome.seconds:.1f}s; run directory: {run_dir.path}")
            print_summary(run_dir.path)
        return outcome.exit_code

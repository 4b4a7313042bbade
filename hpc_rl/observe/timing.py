"""Per-rank phase timing: what every rank of every role spent each training step on.

Every rank owns a `PhaseClock` (hpc_rl/runtime/worker.py builds it; `RankContext.set_phase`
feeds it and the heartbeat from the same call). A rank enters a phase, optionally of a new
step; the time between two entries belongs to the earlier phase. Two files per rank and
restart, under `<run_dir>/timing/` (hpc_rl/rundir.py owns the names):

  <role>.<rank>.<restart>.jsonl   one line per training step, appended when the rank leaves
                                  the step (enters the next one, an evaluation, or ends):
                                  {"role", "rank", "restart", "node", "step", "start", "end"
                                   (epoch seconds), "step_s", "busy_s", "wait_s",
                                   "phases": {phase: seconds}}
  <role>.<rank>.<restart>.now.json  the phase the rank is in and since when (epoch), rewritten
                                  at every entry: {"role", "rank", "restart", "node", "step",
                                  "phase", "since", "waiting"}

A phase whose name starts with "wait" is time the rank spends blocked on its producers
(`is_waiting`). A step's `step_s` is wall time from the rank's first entry of that step to
its first entry of something else, so waits are in it; every rank of a role shows about the
same step time (the driver paces them all), and the straggler is the rank with the most
`busy_s`: `slowest_by_role`. The heartbeat publishes the same phase as its status,
"step <n> <phase>" (`status_text`), which the progress watchdog reads.

Epoch times come from each node's clock: a live view on another node shows "since" with
the skew between the clocks (NTP keeps it far below a step).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from hpc_rl.durable import write_atomic
from hpc_rl.rundir import RunDir

KEEP: Any = object()  # enter(phase) without a step: stay in the current one
WAIT_PREFIX = "wait"
DONE = "done"


def is_waiting(phase: str) -> bool:
    return phase.startswith(WAIT_PREFIX)


def status_text(phase: str, step: Optional[int]) -> str:
    """The heartbeat status of a rank in `phase` of `step` (None: outside training steps)."""
    return phase if step is None else f"step {step} {phase}"


def parse_status(status: str) -> Tuple[Optional[int], str]:
    """Inverse of status_text: (step or None, phase)."""
    parts = status.split(" ", 2)
    if len(parts) == 3 and parts[0] == "step" and parts[1].lstrip("-").isdigit():
        return int(parts[1]), parts[2]
    return None, status


class PhaseClock:
    """One rank's clock. Writing is best effort: a full or vanished disk must not stop
    training for the sake of a record, so OSErrors are kept in `error`, not raised."""

    def __init__(self, run_dir: Union[str, Path], role: str, rank: int, restart: int, node: Optional[str] = None):
        rd = RunDir(run_dir)
        self.steps_path = rd.step_timing(role, rank, restart)
        self.now_path = rd.phase_now(role, rank, restart)
        self.who = {"role": role, "rank": rank, "restart": restart, "node": node or socket.gethostname()}
        self.step: Optional[int] = None
        self.phase: Optional[str] = None
        self.since = 0.0  # epoch, for readers on other nodes
        self._t = 0.0  # monotonic, for durations
        self._step_start = 0.0
        self._phases: Dict[str, float] = {}
        self.error: Optional[str] = None
        try:
            self.steps_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.error = str(exc)

    def enter(self, phase: str, step: Any = KEEP) -> None:
        """Leave the current phase for `phase`; `step`: an int (a training step), None
        (outside steps: start-up, evaluations) or KEEP (the current step)."""
        new = self.step if step is KEEP else step
        if phase == self.phase and new == self.step:
            return  # already there (a caller and its callee both name the phase)
        t, now = time.monotonic(), time.time()
        if self.phase is not None and self.step is not None:
            self._phases[self.phase] = self._phases.get(self.phase, 0.0) + (t - self._t)
        if new != self.step:
            if self.step is not None:
                self._write_step(now)
            self._phases, self._step_start = {}, now
        self.step, self.phase, self._t, self.since = new, phase, t, now
        self._write(self.now_path, None, {**self.who, "step": self.step, "phase": phase, "since": now,
                                          "waiting": is_waiting(phase)})

    def carve(self, phase: str, seconds: float) -> None:
        """Of the current phase's time so far, `seconds` belong to `phase`: for a call that
        reports afterwards how long it was blocked (a refit receive waits for the trainer's
        train step before bytes flow)."""
        if self.step is None or self.phase is None:
            return
        # never more than the phase has had in this step (earlier visits included)
        seconds = max(0.0, min(seconds, time.monotonic() - self._t + self._phases.get(self.phase, 0.0)))
        self._phases[phase] = self._phases.get(phase, 0.0) + seconds
        self._phases[self.phase] = self._phases.get(self.phase, 0.0) - seconds

    def close(self) -> None:
        """The program is over: record the open step and say so."""
        self.enter(DONE, None)

    def _write_step(self, now: float) -> None:
        phases = {k: round(v, 4) for k, v in self._phases.items()}
        wait = sum(v for k, v in self._phases.items() if is_waiting(k))
        total = sum(self._phases.values())
        line = {**self.who, "step": self.step, "start": round(self._step_start, 3), "end": round(now, 3),
                "step_s": round(total, 4), "busy_s": round(total - wait, 4), "wait_s": round(wait, 4), "phases": phases}
        self._write(self.steps_path, json.dumps(line) + "\n", None)  # phases in the order the rank went through them

    def _write(self, path: Path, line: Optional[str], whole: Optional[dict]) -> None:
        try:
            if whole is not None:  # readers never see half of it; no fsync: stale once the rank is gone
                write_atomic(path, json.dumps(whole, sort_keys=True) + "\n", durable=False)
            else:
                with path.open("a") as f:  # closed at once: other nodes see it (NFS close-to-open)
                    f.write(line)
                    f.flush()
        except OSError as exc:
            self.error = str(exc)


# ------------------------------------------------------------------------------- readers
def tail_lines(path: Path, n: Optional[int]) -> List[str]:
    """The last `n` complete lines of a text file (all with n=None), reading only its end:
    a live view polls hundreds of these files."""
    try:
        with open(path, "rb") as f:
            if n is None:
                data = f.read()
            else:
                f.seek(0, os.SEEK_END)
                size, block, data = f.tell(), 4096, b""
                while size > 0 and data.count(b"\n") <= n:
                    take = min(block, size)
                    size -= take
                    f.seek(size)
                    data = f.read(take) + data
                    block *= 2
    except OSError:
        return []
    lines = data.decode(errors="replace").split("\n")
    lines = lines[:-1]  # after the last newline: empty, or a line still being written
    return lines if n is None else lines[-n:]


def _json_lines(lines: Iterable[str]) -> List[dict]:
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn line (a rank killed mid-write): skip it, keep the rest
    return out


def role_order(run_dir: Union[str, Path]) -> List[str]:
    """The plan's role order (trainer first), which every other listing of the run uses."""
    try:
        return [r["name"] for r in json.loads(RunDir(run_dir).plan.read_text())["roles"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def ordered_roles(roles: Iterable[str], order: List[str]) -> List[str]:
    """`roles` in the plan's `order`; roles it does not list last, by name."""
    at = {role: i for i, role in enumerate(order)}
    return sorted(roles, key=lambda role: (at.get(role, len(at)), role))


def rank_name(rec: dict) -> str:
    return f"{rec['role']}:{rec['rank']}"


def read_steps(run_dir: Union[str, Path], last: Optional[int] = None) -> List[dict]:
    """Every rank's step lines (each file's `last` only, when given). A step recomputed
    after a resume appears once: the latest restart's line wins."""
    by: Dict[Tuple[str, int, int], dict] = {}
    for path in sorted(RunDir(run_dir).timing.glob("*.jsonl")):
        for rec in _json_lines(tail_lines(path, last)):
            key = (rec.get("role"), rec.get("rank"), rec.get("step"))
            if key not in by or rec.get("restart", 0) >= by[key].get("restart", 0):
                by[key] = rec
    return sorted(by.values(), key=lambda r: (r["step"], r["role"], r["rank"]))


def read_now(run_dir: Union[str, Path]) -> List[dict]:
    """The current phase of every rank of the latest restart (older restarts' ranks are gone)."""
    recs = []
    for path in sorted(RunDir(run_dir).timing.glob("*" + RunDir.PHASE_NOW_SUFFIX)):
        try:
            recs.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being replaced this instant, or torn: the next poll reads it
    latest = max((r.get("restart", 0) for r in recs), default=0)
    return sorted((r for r in recs if r.get("restart", 0) == latest), key=lambda r: (r["role"], r["rank"]))


def slowest_by_role(run_dir: Union[str, Path], step: int) -> Dict[str, dict]:
    """role -> the step line of its rank with the most busy time at `step`, plus `ranks`
    (how many reported) and `busy_median_s`."""
    return slowest_of(read_steps(run_dir), step)


def slowest_of(steps: List[dict], step: int) -> Dict[str, dict]:
    """slowest_by_role over step lines already read (read_steps)."""
    rows = [r for r in steps if r["step"] == step]
    by: Dict[str, List[dict]] = {}
    for r in rows:
        by.setdefault(r["role"], []).append(r)
    out = {}
    for role, rs in by.items():
        worst = max(rs, key=lambda r: (r["busy_s"], -r["rank"]))
        out[role] = dict(worst, ranks=len(rs), busy_median_s=statistics.median(r["busy_s"] for r in rs))
    return out


def slowest_ranks(run_dir: Union[str, Path], steps: Optional[List[dict]] = None) -> Dict[str, dict]:
    """role -> its rank with the largest mean busy time per step over the run:
    {"rank": "generator:1", "node", "busy_s_mean", "step_s_mean", "steps", "ranks",
    "busy_s_mean_median" (the role's typical rank, to see how far the slowest is off)}."""
    per: Dict[Tuple[str, int], List[dict]] = {}
    for r in read_steps(run_dir) if steps is None else steps:
        per.setdefault((r["role"], r["rank"]), []).append(r)
    by_role: Dict[str, List[dict]] = {}
    for (role, rank), rs in per.items():
        by_role.setdefault(role, []).append({
            "rank": f"{role}:{rank}", "node": rs[-1].get("node"), "steps": len(rs),
            "busy_s_mean": round(statistics.fmean(r["busy_s"] for r in rs), 4),
            "step_s_mean": round(statistics.fmean(r["step_s"] for r in rs), 4)})
    out = {}
    for role in ordered_roles(by_role, role_order(run_dir)):
        ranks = by_role[role]
        worst = max(ranks, key=lambda x: x["busy_s_mean"])
        out[role] = dict(worst, ranks=len(ranks),
                         busy_s_mean_median=round(statistics.median(x["busy_s_mean"] for x in ranks), 4))
    return out

"""What authentication did: values and messages rejected, and the MAC work, per process
and job-wide (issue 29).

Every process counts in runtime/signed_store.py: `REJECTED` (by store key or message
label) and `OPS` (SignedStore calls by method, MACs made and checked and their bytes,
sealed messages). Here:

- `kind` folds a label's numbers away ("refit/0/ready/2/1" -> "refit/*/ready/*/*"), so
  counts group by what was forged, not by rank or step;
- `mark_step` snapshots OPS when a training step starts on this rank (messaging/p2p.py
  calls it with its own mark): per-step figures for bench/auth_cost.py;
- a generator rank adds its engine's worker processes (`add_workers`): vLLM's workers are
  processes of their own, and they read refit keys;
- each rank of an RL run writes `auth/<role>.<rank>.<restart>.json` at its end
  (`write_rank_report`, once its heartbeat stopped: nothing of it reads the store later);
- after the final barrier the driver sums every rank's file of every restart
  (`job_totals`) into summary.json: `auth_rejected` (the job-wide total),
  `auth_rejected_by_kind`, `auth_rejected_by_role`, and `auth_reports_missing` when a rank
  of this restart left no file.

The reports are files in the run directory, not store keys: a stranger who reaches the
store can overwrite its keys, not the job's files.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping

from hpc_rl.durable import write_atomic
from hpc_rl.rundir import RunDir

from .signed_store import OPS, REJECTED

_NUMBERS = re.compile(r"\b[0-9a-f]{16}\b|(?<![A-Za-z0-9])\d+(?![A-Za-z0-9])")  # ranks, steps, restarts; a group's hash (sealed.py)
PER_STEP: Dict[int, Dict[str, int]] = {}  # training step -> this process's OPS during it
_mark: Dict[str, Any] = {"step": None, "at": Counter()}
WORKERS: Dict[str, Counter] = {"rejected": Counter(), "ops": Counter()}  # this rank's engine workers


def kind(label: str) -> str:
    return _NUMBERS.sub("*", label)


def by_kind(counts: Mapping[str, int]) -> Dict[str, int]:
    out: Counter = Counter()
    for label, n in counts.items():
        out[kind(label)] += n
    return dict(out)


def _copy(counter: Counter) -> Counter:
    """A snapshot of a counter another thread (the heartbeat's) may be adding a key to."""
    for _ in range(10):
        try:
            return Counter(dict(counter))
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return Counter(dict(counter))


def mark_step(step: int) -> None:
    """A training step starts here: what OPS counted since the last mark belongs to the
    previous step."""
    now = _copy(OPS)
    if _mark["step"] is not None:
        PER_STEP[_mark["step"]] = dict(now - _mark["at"])
    _mark.update(step=step, at=now)


def process_counts() -> Dict[str, Any]:
    """This process's counts: what an engine worker answers its generator."""
    return {"pid": os.getpid(), "rejected": dict(_copy(REJECTED)), "ops": dict(_copy(OPS))}


def add_workers(counts: Iterable[Mapping[str, Any]]) -> None:
    """Fold in the counts of this rank's engine workers (process_counts of each)."""
    for c in counts:
        if c.get("pid") == os.getpid():  # the engine runs in this process: counted already
            continue
        WORKERS["rejected"].update(c.get("rejected") or {})
        WORKERS["ops"].update(c.get("ops") or {})


def rank_report() -> Dict[str, Any]:
    """This rank's counts, its engine workers' rejections included (their ops apart)."""
    mark_step(-1)
    rejected = _copy(REJECTED) + WORKERS["rejected"]
    return {"rejected_total": sum(rejected.values()), "rejected_by_kind": by_kind(rejected),
            "ops": dict(_copy(OPS)), "per_step": {str(k): v for k, v in sorted(PER_STEP.items()) if k >= 0},
            "engine_workers": {"rejected_by_kind": by_kind(WORKERS["rejected"]), "ops": dict(WORKERS["ops"])}}


def write_rank_report(run_dir: Path, role: str, rank: int, restart: int) -> Path:
    path = RunDir(run_dir).auth_report(role, rank, restart)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(rank_report(), sort_keys=True) + "\n")
    return path


def job_totals(run_dir: Path, plan, restart: int) -> Dict[str, Any]:
    """Every rank's report of every restart so far, summed (the summary's auth_* fields)."""
    rd = RunDir(run_dir)
    total, kinds, roles = 0, Counter(), Counter()
    missing: List[str] = []
    for r in range(restart + 1):
        for role in plan.roles:
            roles[role.name] += 0
            for k in range(role.tasks):
                try:
                    rep = json.loads(rd.auth_report(role.name, k, r).read_text())
                except (OSError, ValueError):  # a rank of an earlier attempt may have died first
                    if r == restart:
                        missing.append(f"{role.name}:{k}")
                    continue
                total += int(rep.get("rejected_total", 0))
                kinds.update(rep.get("rejected_by_kind") or {})
                roles[role.name] += int(rep.get("rejected_total", 0))
    out: Dict[str, Any] = {"auth_rejected": total, "auth_rejected_by_kind": dict(sorted(kinds.items())),
                           "auth_rejected_by_role": dict(roles)}
    if missing:
        out["auth_reports_missing"] = missing
    return out

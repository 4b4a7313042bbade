"""Small Python objects between ranks: orders, sampled rows, scores.

The control-plane data of a step is kilobytes to megabytes: it travels pickled, sealed with
the job's MAC and checked before unpickling (runtime/sealed.py), point to point from
producer to consumer (`send` / `recv`, global ranks over the world group), or as one
broadcast inside the group that consumes it (`share`). `routes.py` says who talks
to whom; every message is counted per rank (`COUNTS`) so a run can report its traffic.
Tensors that scale with the model (refit) have their own groups and transports.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

import torch.distributed as dist

from hpc_rl.runtime import auth_stats, sealed

COUNTS: Counter = Counter()  # this rank's object messages and their bytes, sent and received
PER_STEP: Dict[int, Dict[str, int]] = {}  # training step -> this rank's traffic from that step's start
_last_mark: Dict[str, Any] = {"step": None, "at": Counter()}


def mark_step(step: int) -> None:
    """A training step starts here on this rank: what was counted since the last mark
    belongs to the previous step (bench/exchange.py reads these per-step figures). The
    authentication counts take the same mark (runtime/auth_stats.py, bench/auth_cost.py)."""
    auth_stats.mark_step(step)
    if _last_mark["step"] is not None:
        PER_STEP[_last_mark["step"]] = dict(COUNTS - _last_mark["at"])
    _last_mark.update(step=step, at=Counter(COUNTS))


def traffic() -> Dict[str, Any]:
    """This rank's totals and per-step figures (the last step closes here)."""
    mark_step(-1)
    return {"total": dict(COUNTS), "per_step": {str(k): v for k, v in sorted(PER_STEP.items()) if k >= 0}}


def send(obj: Any, dst: int) -> None:
    """`obj` to global rank `dst`, which calls `recv(src=<this rank>)`."""
    n = sealed.send(obj, dst)
    COUNTS["sent_messages"] += 1
    COUNTS["sent_bytes"] += n


def recv(src: int) -> Any:
    """The next object from `src`; MessageRejected (before unpickling) if it does not carry
    the job's MAC for that route."""
    obj, n = sealed.recv(src)
    COUNTS["received_messages"] += 1
    COUNTS["received_bytes"] += n
    return obj


def share(obj: Any, src: int, group: Optional[dist.ProcessGroup]) -> Any:
    """`obj` from global rank `src` to every member of `group` (its consumers: one group
    broadcast, counted as one message per receiving member); None group or one member:
    nothing to share."""
    if group is None or dist.get_world_size(group) == 1:
        return obj
    out, n = sealed.broadcast(obj, src, group)
    if dist.get_rank() == src:
        receivers = dist.get_world_size(group) - 1
        COUNTS["sent_messages"] += receivers
        COUNTS["sent_bytes"] += receivers * n
        return obj
    COUNTS["received_messages"] += 1
    COUNTS["received_bytes"] += n
    return out


def gather_all(obj: Any, group: dist.ProcessGroup) -> List[Any]:
    """Every member's `obj`, in group-rank order, on every member."""
    return sealed.all_gather(obj, group)


def strided(n: int, part: int, parts: int) -> List[int]:
    """The indices of `range(n)` that member `part` of `parts` handles (round robin)."""
    return list(range(part, n, parts))


def interleave(pieces: Sequence[Sequence[Any]], n: int) -> List[Any]:
    """Inverse of `strided`: pieces[k] holds items k, k+parts, ...; returns them in order."""
    out: List[Any] = [None] * n
    parts = len(pieces)
    for k, piece in enumerate(pieces):
        for j, item in enumerate(piece):
            out[k + j * parts] = item
    return out

"""The refit plan: from a source and a destination layout, the exact slice transfers.

Rules:
  - a destination rank receives only bytes it keeps (its own boxes);
  - each byte enters a destination NVLink domain over the inter-domain network at most
    once: it lands on one destination rank of that domain that needs it, which forwards it
    to the domain's other ranks that need it (stage 1, over NVLink);
  - a byte already held by a source rank in the destination's domain never crosses domains;
  - among source replicas the least-loaded holder (bytes sent so far) sends, and the
    landing rank is the one that took in the fewest inter-domain bytes so far, ties to the
    lowest rank: deterministic, so both sides compute the same plan without messages;
  - transfers are grouped into buckets under a byte budget, in a fixed order.

The work is done on the grid formed by all box boundaries of a tensor (a cell is held by
the same source ranks and needed by the same destination ranks throughout), then cells
are merged back into boxes where they line up.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from .layout import Layout, TensorLayout, check_pair


@dataclass(frozen=True)
class Transfer:
    name: str
    start: Tuple[int, ...]
    stop: Tuple[int, ...]
    src: int
    dst: int
    stage: int  # 0: from a source rank; 1: forwarded inside the destination's domain
    inter_domain: bool
    nbytes: int


@dataclass
class Plan:
    transfers: List[Transfer]
    buckets: List[List[Transfer]]
    planning_s: float = 0.0
    stats: Dict[str, float] = field(default_factory=dict)

    def bytes_received(self) -> Dict[int, int]:
        out: Dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.dst] += t.nbytes
        return dict(out)


def _cells_of(src: TensorLayout, dst: TensorLayout):
    nd = len(src.shape)
    pieces = src.pieces + dst.pieces
    cuts = [sorted({0, n} | {p.start[d] for p in pieces} | {p.stop[d] for p in pieces}) for d, n in enumerate(src.shape)]
    index = [{v: i for i, v in enumerate(c)} for c in cuts]
    holders: Dict[tuple, List[int]] = defaultdict(list)
    needers: Dict[tuple, List[int]] = defaultdict(list)
    for table, plist in ((holders, src.pieces), (needers, dst.pieces)):
        for p in plist:
            for cell in itertools.product(*[range(index[d][p.start[d]], index[d][p.stop[d]]) for d in range(nd)]):
                if p.rank not in table[cell]:
                    table[cell].append(p.rank)
    return cuts, holders, needers


def _merge(boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]]) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """Merge boxes that touch along one dimension and agree on all others (repeat until stable)."""
    boxes = sorted(boxes)
    changed = True
    while changed and len(boxes) > 1:
        changed = False
        out = [boxes[0]]
        for b in boxes[1:]:
            a = out[-1]
            nd = len(a[0])
            joined = None
            for d in range(nd):
                if a[1][d] == b[0][d] and all(a[0][k] == b[0][k] and a[1][k] == b[1][k] for k in range(nd) if k != d):
                    start, stop = list(a[0]), list(a[1])
                    stop[d] = b[1][d]
                    joined = (tuple(start), tuple(stop))
                    break
            if joined:
                out[-1] = joined
                changed = True
            else:
                out.append(b)
        boxes = sorted(out)
    return boxes


def plan_refit(src: Layout, dst: Layout, domain_of: Optional[Mapping[int, str]] = None,
               bucket_bytes: int = 256 << 20) -> Plan:
    """The transfers that move every byte the destination needs. `domain_of` maps ranks
    (of both sides) to NVLink domains; without it every rank is its own domain."""
    t0 = time.perf_counter()
    check_pair(src, dst)
    dom = (lambda r: domain_of.get(r, f"rank{r}")) if domain_of is not None else (lambda r: f"rank{r}")
    sent: Dict[int, int] = defaultdict(int)
    landed: Dict[int, int] = defaultdict(int)  # inter-domain bytes each destination rank took in
    transfers: List[Transfer] = []
    for name in sorted(src.tensors):
        s, d = src.tensors[name], dst.tensors[name]
        cuts, holders, needers = _cells_of(s, d)
        # (src, dst, stage, inter) -> boxes; filled per cell, merged per key below
        routes: Dict[Tuple[int, int, int, bool], List[tuple]] = defaultdict(list)
        for cell in sorted(needers):
            lo = tuple(cuts[k][i] for k, i in enumerate(cell))
            hi = tuple(cuts[k][i + 1] for k, i in enumerate(cell))
            nbytes = s.itemsize
            for a, b in zip(lo, hi):
                nbytes *= b - a
            if nbytes == 0:
                continue
            have = holders[cell]
            by_domain: Dict[str, List[int]] = defaultdict(list)
            for r in sorted(needers[cell]):
                by_domain[dom(r)].append(r)
            for domain in sorted(by_domain):
                want = by_domain[domain]
                local = [h for h in have if dom(h) == domain]
                pool = local or have
                source = min(pool, key=lambda h: (sent[h], h))
                if local:  # the bytes are already in this domain: direct, no domain crossing
                    for r in want:
                        routes[(source, r, 0, False)].append((lo, hi))
                        sent[source] += nbytes
                else:  # one crossing to a landing rank that keeps the bytes, then NVLink fan-out
                    landing = min(want, key=lambda r: (landed[r], r))  # spread landings over the NICs
                    landed[landing] += nbytes
                    routes[(source, landing, 0, True)].append((lo, hi))
                    sent[source] += nbytes
                    for r in want:
                        if r == landing:
                            continue
                        routes[(landing, r, 1, False)].append((lo, hi))
                        sent[landing] += nbytes
        # stage 0 before stage 1: a forward never comes before the transfer that lands its bytes
        for (a, b, stage, inter), boxes in sorted(routes.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
            for lo, hi in _merge(boxes):
                n = s.itemsize
                for x, y in zip(lo, hi):
                    n *= y - x
                transfers.append(Transfer(name, lo, hi, a, b, stage, inter, n))
    buckets = _bucket(transfers, bucket_bytes)
    plan = Plan(transfers, buckets, time.perf_counter() - t0)
    plan.stats = {"transfers": len(transfers), "buckets": len(buckets),
                  "bytes": float(sum(t.nbytes for t in transfers)),
                  "inter_domain_bytes": float(sum(t.nbytes for t in transfers if t.inter_domain)),
                  "planning_s": plan.planning_s}
    return plan


def _bucket(transfers: List[Transfer], budget: int) -> List[List[Transfer]]:
    """Consecutive transfers (in plan order) up to `budget` bytes per bucket; inside a
    bucket the stage-0 transfers come before the forwards that depend on them. A single
    transfer larger than the budget gets a bucket of its own."""
    buckets: List[List[Transfer]] = []
    cur: List[Transfer] = []
    size = 0
    for t in transfers:
        if cur and size + t.nbytes > budget:
            buckets.append(sorted(cur, key=lambda x: x.stage))
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur:
        buckets.append(sorted(cur, key=lambda x: x.stage))
    return buckets


def gather_broadcast_bytes(dst: Layout) -> int:
    """Bytes a gather-then-broadcast refit delivers: each whole tensor to every destination
    rank that keeps any part of it (the gather onto one rank not counted)."""
    total = 0
    for t in dst.tensors.values():
        full = t.itemsize
        for n in t.shape:
            full *= n
        total += full * len({p.rank for p in t.pieces})
    return total

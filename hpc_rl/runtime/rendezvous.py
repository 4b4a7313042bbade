"""Ranks meet on a TCPStore hosted by trainer rank 0; no Ray head, no extra service.

Each rank announces itself under its global rank, then waits until all have arrived.
A rank that cannot see everyone within the timeout fails naming the ranks (role and
rank) that never arrived, instead of hanging on a collective later.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Dict, List, Optional

import torch.distributed as dist

from hpc_rl.plan.job_plan import JobPlan

from .identity import RankIdentity, role_offsets


class RendezvousError(RuntimeError):
    pass


def describe_rank(plan: JobPlan, global_rank: int) -> str:
    for role, (first, n) in role_offsets(plan).items():
        if first <= global_rank < first + n:
            return f"{role}:{global_rank - first}"
    return f"rank {global_rank}"


def connect_store(ident: RankIdentity, plan: JobPlan, addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    host = ident.global_rank == 0  # trainer rank 0: the plan puts the trainer first
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return dist.TCPStore(addr, port, world_size=ident.world_size, is_master=host,
                                 timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        except (RuntimeError, OSError) as exc:  # the host may not listen yet
            if host or time.monotonic() > deadline:
                raise RendezvousError(f"{ident}: cannot reach the rendezvous store of trainer:0 at {addr}:{port} "
                                      f"within {timeout_s:.0f}s: {exc}") from exc
            time.sleep(0.5)


def rendezvous(store: dist.TCPStore, ident: RankIdentity, plan: JobPlan, timeout_s: float,
               facts: Optional[dict] = None) -> Dict[int, dict]:
    """Announce this rank (and its node's topology facts), wait for all; returns every
    rank's announcement by (provisional, Slurm-order) global rank."""
    me = {"role": ident.role, "role_rank": ident.role_rank, "node": ident.node, "local_rank": ident.local_rank,
          **(facts or {})}
    store.set(f"rdzv/{ident.restart}/{ident.global_rank}", json.dumps(me))
    store.add(f"rdzv/{ident.restart}/arrived", 1)
    deadline = time.monotonic() + timeout_s
    while store.add(f"rdzv/{ident.restart}/arrived", 0) < ident.world_size:
        if time.monotonic() > deadline:
            missing = missing_ranks(store, ident)
            names = ", ".join(describe_rank(plan, r) for r in missing)
            raise RendezvousError(f"{ident}: rendezvous timed out after {timeout_s:.0f}s; never arrived: {names}")
        time.sleep(0.05)
    return {r: json.loads(store.get(f"rdzv/{ident.restart}/{r}")) for r in range(ident.world_size)}


def missing_ranks(store: dist.TCPStore, ident: RankIdentity) -> List[int]:
    keys = [f"rdzv/{ident.restart}/{r}" for r in range(ident.world_size)]
    return [r for r, k in enumerate(keys) if not store.check([k])]

"""Ranks meet on a TCPStore hosted by trainer rank 0; no Ray head, no extra service.

Each rank announces itself under its global rank, then waits until all have arrived.
A rank that cannot see everyone within the timeout fails naming the ranks (role and
rank) that never arrived, instead of hanging on a collective later.

Announcements are signed with the job's secret (runtime/signed_store.py): a rank is
admitted only once its record verifies, so a process without the secret cannot register
as a rank (its record is rejected and counted), and a rank started with another job's
secret sees no valid record of anyone and fails naming the reason. The arrival counter
(`store.add`) cannot be signed; it only says when to look, never who is in.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from datetime import timedelta
from typing import Dict, List, Optional

import torch.distributed as dist

from hpc_rl.plan.job_plan import JobPlan

from .identity import RankIdentity, role_offsets
from .signed_store import SignedStore, rejected_total


class RendezvousError(RuntimeError):
    pass


def describe_rank(plan: JobPlan, global_rank: int) -> str:
    for role, (first, n) in role_offsets(plan).items():
        if first <= global_rank < first + n:
            return f"{role}:{global_rank - first}"
    return f"rank {global_rank}"


def connect_store(ident: RankIdentity, plan: JobPlan, addr: str, port: int, timeout_s: float,
                  secret: bytes) -> SignedStore:
    """The job's store (trainer rank 0 hosts it), its values signed with `secret`."""
    host = ident.global_rank == 0  # trainer rank 0: the plan puts the trainer first
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = listen_on(addr, port) if host else None
            return SignedStore(dist.TCPStore(addr, port, world_size=ident.world_size, is_master=host,
                                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                                              master_listen_fd=fd), secret)
        except (RuntimeError, OSError) as exc:  # the host may not listen yet
            if host or time.monotonic() > deadline:
                raise RendezvousError(f"{ident}: cannot reach the rendezvous store of trainer:0 at {addr}:{port} "
                                      f"within {timeout_s:.0f}s: {exc}") from exc
            time.sleep(0.5)


def listen_on(addr: str, port: int) -> Optional[int]:
    """A listening socket on the address the ranks connect to (the plan's, HPC_RL_MASTER_ADDR),
    handed to the TCPStore host: left to itself it listens on every interface. None (every
    interface, with a warning) when that address is not one of this node's."""
    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((addr, port), family=family, backlog=4096).detach()  # the store owns the fd
    except OSError as exc:
        print(f"hpc_rl: the store cannot listen on {addr}:{port} alone ({exc}); listening on every interface "
              f"(values stay authenticated)", file=sys.stderr, flush=True)
        return None


def rendezvous(store: SignedStore, ident: RankIdentity, plan: JobPlan, timeout_s: float,
               facts: Optional[dict] = None) -> Dict[int, dict]:
    """Announce this rank (and its node's topology facts), wait for all; returns every
    rank's announcement by (provisional, Slurm-order) global rank. Only records that carry
    the job's MAC count as arrivals."""
    me = {"role": ident.role, "role_rank": ident.role_rank, "node": ident.node, "local_rank": ident.local_rank,
          **(facts or {})}
    store.set(f"rdzv/{ident.restart}/{ident.global_rank}", json.dumps(me))
    store.add(f"rdzv/{ident.restart}/arrived", 1)
    deadline = time.monotonic() + timeout_s
    pending = list(range(ident.world_size))
    while True:
        # the unsigned counter only says when to look; every record must verify
        if store.add(f"rdzv/{ident.restart}/arrived", 0) >= ident.world_size:
            pending = missing_ranks(store, ident, pending)
            if not pending:
                break
        if time.monotonic() > deadline:
            raise RendezvousError(_timeout_message(store, ident, plan, timeout_s, missing_ranks(store, ident, pending)))
        time.sleep(0.05)
    return {r: json.loads(store.get(f"rdzv/{ident.restart}/{r}")) for r in range(ident.world_size)}


def _timeout_message(store: SignedStore, ident: RankIdentity, plan: JobPlan, timeout_s: float,
                     missing: List[int]) -> str:
    names = ", ".join(describe_rank(plan, r) for r in missing)
    forged = [r for r in missing if store.raw.check([f"rdzv/{ident.restart}/{r}"])]
    text = f"{ident}: rendezvous timed out after {timeout_s:.0f}s; never arrived: {names}"
    if forged:
        text += (f"; the records under {', '.join(describe_rank(plan, r) for r in forged)} do not carry this job's "
                 f"MAC ({rejected_total()} values rejected): written by a process without the job's secret, or "
                 f"this rank's HPC_RL_JOB_KEY is not the job's")
    return text


def missing_ranks(store: SignedStore, ident: RankIdentity, ranks: Optional[List[int]] = None) -> List[int]:
    """The ranks (of `ranks`, default all) without a verified record."""
    ranks = range(ident.world_size) if ranks is None else ranks
    return [r for r in ranks if not store.check([f"rdzv/{ident.restart}/{r}"])]

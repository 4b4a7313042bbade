"""Who am I? A rank's identity from Slurm's variables or the local launcher's.

Every task of a run starts the same worker; the launcher tells it its role through
HPC_RL_ROLE (the batch script sets it per `srun --het-group`, the local launcher per
process). Rank within the role, local rank and node come from RankEnv (runtime/env.py:
the local launcher's HPC_RL_* variables, else Slurm's role-local equivalents). Global
ranks follow the plan's role order, so every rank computes every other rank's global id
without asking.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

from hpc_rl.plan.job_plan import JobPlan

from . import env
from .env import RankEnv


@dataclass(frozen=True)
class RankIdentity:
    role: str
    role_rank: int
    role_size: int
    global_rank: int
    world_size: int
    local_rank: int
    node: str
    restart: int
    job_id: str

    def __str__(self) -> str:
        return f"{self.role}[{self.role_rank}/{self.role_size}] (global {self.global_rank}/{self.world_size}, node {self.node}, local {self.local_rank})"


def role_offsets(plan: JobPlan) -> Dict[str, Tuple[int, int]]:
    """role -> (first global rank, number of ranks), in the plan's role order."""
    out, start = {}, 0
    for r in plan.roles:
        out[r.name] = (start, r.tasks)
        start += r.tasks
    return out


def identity_from_env(plan: JobPlan, environ: Optional[Mapping[str, str]] = None) -> RankIdentity:
    e = RankEnv.from_env(environ)
    offsets = role_offsets(plan)
    if e.role is None or e.role not in offsets:
        raise RuntimeError(f"{env.ROLE}={e.role!r}: every rank needs its role from the launcher; roles of this plan: {list(offsets)}")
    first, size = offsets[e.role]
    if e.role_rank is None:
        raise RuntimeError(f"neither {env.ROLE_RANK} nor {env.SLURM_EQUIVALENTS[env.ROLE_RANK][0]} is set: "
                           "start ranks through a launcher")
    ntasks = size if e.role_size is None else e.role_size
    if ntasks != size or not 0 <= e.role_rank < size:
        raise RuntimeError(f"role {e.role}: the launcher started {ntasks} tasks (this is rank {e.role_rank}) but the plan has {size}")
    world = sum(n for _, n in offsets.values())
    return RankIdentity(
        role=e.role,
        role_rank=e.role_rank,
        role_size=size,
        global_rank=first + e.role_rank,
        world_size=world,
        local_rank=e.local_rank or 0,
        node=e.node or socket.gethostname(),
        restart=e.restart or 0,
        job_id=e.job_id or "local",
    )


PORT_BASE = 20000


def ephemeral_low() -> int:
    """First port of the kernel's ephemeral range (outgoing connections take ports there)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def rendezvous_port(job_id: str, restart: int, eph_low: Optional[int] = None) -> int:
    """A port every rank derives alike from the job id and restart count (no scontrol in
    containers): a requeued job gets a fresh port, so stale sockets of the last attempt
    never collide with the new store. It lies below the ephemeral range: any outgoing
    connection on the node (srun's I/O, vLLM's sockets) may hold a port of that range, and
    a store that cannot listen fails the job with EADDRINUSE (seen at job id 101 here)."""
    digits = int("".join(ch for ch in job_id if ch.isdigit()) or "0")
    low = ephemeral_low() if eph_low is None else eph_low
    span = low - PORT_BASE if low - PORT_BASE >= 1024 else 10000
    return PORT_BASE + (digits * 131 + restart * 17) % span

"""The job's process groups, built identically on every rank.

- world: every rank (control collectives: barriers, stop decisions)
- role: the ranks of this rank's role
- refit: trainer + generators (weights flow trainer -> vLLM)
- teachers[<group>]: trainer + one teacher group (scoring requests and logprobs)
Plus the TCPStore itself as the control channel for flags and heartbeats.

`torch.distributed.new_group` must be entered by every rank in the same order, members
or not, so every group is created everywhere from the plan alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from hpc_rl.plan.job_plan import JobPlan

from .identity import RankIdentity, role_offsets


def ranks_of(plan: JobPlan, *roles: str) -> List[int]:
    offsets = role_offsets(plan)
    out: List[int] = []
    for role in roles:
        first, n = offsets[role]
        out.extend(range(first, first + n))
    return out


@dataclass
class ProcessGroups:
    world: dist.ProcessGroup
    role: dist.ProcessGroup
    refit: Optional[dist.ProcessGroup]  # None on ranks outside trainer + generators
    teachers: Dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)  # None where not a member
    members: Dict[str, List[int]] = field(default_factory=dict)  # group name -> global ranks


def backend_for(plan: JobPlan, roles: List[str]) -> str:
    """NCCL where every member role computes on GPUs; gloo otherwise (CPU roles, this machine)."""
    on_gpus = all(plan.role(r).gpus_per_node > 0 for r in roles)
    return "nccl" if on_gpus and torch.cuda.is_available() else "gloo"


def build_groups(store, ident: RankIdentity, plan: JobPlan, timeout_s: float) -> ProcessGroups:
    """`store`: the job's SignedStore; gloo's C++ rendezvous needs the raw c10d store under
    it (its keys are unsigned: docs/security.md)."""
    # The world group is the control channel: gloo, so CPU-only roles (env) can join it.
    dist.init_process_group("gloo", store=dist.PrefixStore(f"pg/{ident.restart}", store.raw), rank=ident.global_rank,
                            world_size=ident.world_size, timeout=timedelta(seconds=timeout_s))
    me = ident.global_rank
    members: Dict[str, List[int]] = {}
    made: Dict[str, Optional[dist.ProcessGroup]] = {}

    def group(name: str, roles: List[str]) -> None:
        ranks = ranks_of(plan, *roles)
        members[name] = ranks
        pg = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s), backend=backend_for(plan, roles))
        made[name] = pg if me in ranks else None

    for r in plan.roles:
        group(f"role/{r.name}", [r.name])
    roles = [r.name for r in plan.roles]
    trainer = roles[0]
    if "generator" in roles:
        group("refit", [trainer, "generator"])
    teacher_roles = [r for r in roles if r.startswith("teacher/")]
    for t in teacher_roles:
        group(t, [trainer, t])
    return ProcessGroups(
        world=dist.group.WORLD,
        role=made[f"role/{ident.role}"],
        refit=made.get("refit"),
        teachers={t.split("/", 1)[1]: made[t] for t in teacher_roles},
        members=members,
    )


def configure_device(ident: RankIdentity, gpus_per_node: int, cpus_per_node: int, tasks_per_node: int) -> str:
    """One GPU per local rank on GPU nodes; CPU threads split between local ranks."""
    if gpus_per_node > 0 and torch.cuda.is_available():
        torch.cuda.set_device(ident.local_rank % torch.cuda.device_count())
        return f"cuda:{torch.cuda.current_device()}"
    torch.set_num_threads(max(1, cpus_per_node // max(tasks_per_node, 1)))
    pin_cpus(ident.role, os.environ.get(CPU_AFFINITY, ""))
    return "cpu"


# "role=cpus;role=cpus" (cpus like 0 or 0,1; a teacher's role is teacher/<name>): pins each
# listed role's process to its CPUs with as many threads. Benchmarks on one small machine
# use it to give each role a core of its own, as separate nodes would (bench/async.py).
CPU_AFFINITY = "HPC_RL_CPU_AFFINITY"


def pin_cpus(role: str, spec: str) -> None:
    for part in filter(None, spec.split(";")):
        name, _, cpus = part.partition("=")
        if name.strip() != role:
            continue
        chosen = {int(c) for c in cpus.split(",") if c.strip()}
        os.sched_setaffinity(0, chosen)
        torch.set_num_threads(len(chosen))
        # vLLM's CPU workers bind their OpenMP threads themselves: to these CPUs, not all of them
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in sorted(chosen)))

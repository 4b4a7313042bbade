"""`run.program=comm_check`: prove a job's wiring before spending a 224-node allocation.

Every rank all-reduces in its role group; trainer rank 0 broadcasts a tensor over the
refit group (to the generators) and over each trainer+teacher group; everyone checks the
numbers and reports what it saw. It exercises exactly the groups the RL loop uses.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict

import torch
import torch.distributed as dist

from . import sealed


def run(ctx) -> Dict[str, Any]:
    ident, groups = ctx.ident, ctx.groups
    out: Dict[str, Any] = {"role": ident.role, "role_rank": ident.role_rank, "global_rank": ident.global_rank,
                           "node": ident.node, "device": ctx.device, "timing": dict(ctx.timing),
                           # where Slurm's topology plugin put this task (spine.rack1.node1), if it says
                           "topology_addr": os.environ.get("SLURM_TOPOLOGY_ADDR")}

    # role group: sum of (role_rank + 1) over the role is n(n+1)/2
    t0 = time.perf_counter()
    x = torch.tensor([float(ident.role_rank + 1)])
    dist.all_reduce(x, group=groups.role)
    n = ident.role_size
    expect = n * (n + 1) / 2
    if x.item() != expect:
        raise RuntimeError(f"{ident}: role all-reduce gave {x.item()}, expected {expect}")
    out["role_allreduce"] = x.item()

    # trainer -> generators (refit) and trainer -> each teacher group: a broadcast from trainer rank 0
    payload = torch.arange(16, dtype=torch.float32) * 3.0 + 1.0
    received = {}
    for name, pg in [("refit", groups.refit), *[(f"teacher/{t}", g) for t, g in groups.teachers.items()]]:
        if pg is None:
            continue
        buf = payload.clone() if ident.global_rank == 0 else torch.zeros_like(payload)
        dist.broadcast(buf, src=0, group=pg)
        if not torch.equal(buf, payload):
            raise RuntimeError(f"{ident}: broadcast over {name} delivered {buf.tolist()[:4]}..., expected {payload.tolist()[:4]}...")
        received[name] = float(buf.sum())
    out["broadcasts"] = received
    out["ep_group"] = _ep_group_check(ctx)
    ctx.finish()  # before the final barrier: no peer sees this rank go quiet first
    dist.barrier(group=groups.world)
    out["seconds"] = time.perf_counter() - t0
    ctx.log.info("comm_check ok: role all-reduce %s, broadcasts %s", out["role_allreduce"], sorted(received))
    return out


def _ep_group_check(ctx) -> Dict[str, Any]:
    """Trainer EP groups (consecutive placed ranks, expert tensor parallel innermost): each
    member reports where it runs, so a test or an operator sees whether a group straddles
    domains. Every rank enters every new_group call, members or not."""
    plan, cfg, ident = ctx.plan, ctx.cfg, ctx.ident
    trainer = plan.roles[0]
    size = trainer.parallel["ep"] * cfg.trainer.parallel.etp
    if size <= 1 or trainer.tasks % size:
        return {}
    mine: Dict[str, Any] = {}
    for start in range(0, trainer.tasks, size):
        ranks = list(range(start, start + size))  # the trainer's global ranks start at 0
        pg = dist.new_group(ranks, backend="gloo")
        if ident.global_rank in ranks:
            where = sealed.all_gather({"node": ident.node, "topology_addr": os.environ.get("SLURM_TOPOLOGY_ADDR")}, pg)
            mine = {"ranks": ranks, "members": where}
    return mine

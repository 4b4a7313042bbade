"""Starting the roles that serve (generators, teachers, env ranks) and the facts the
trainer's setup needs from the run: the tokenizer's pad id and the refit domain map."""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

import torch.distributed as dist

from hpc_rl.messaging.routes import Routes

END_KEY = "rl/{restart}/over"  # set by the driver when the run ends; idle ranks wait for it
IDLE_POLL_S = 1.0


def pad_id_of(model_path: str) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return tok.pad_token_id if tok.pad_token_id is not None else 0


def serve_role(ctx, routes: Routes) -> Dict[str, Any]:
    """Build this rank's role, meet the others once every model is loaded, then serve."""
    role = ctx.ident.role
    t0 = time.perf_counter()
    if role == "generator" and not routes.leads_engine(ctx.ident.role_rank):
        from hpc_rl.roles.generator import EngineFollowerRole

        follower = EngineFollowerRole(ctx, routes)
        dist.barrier(group=ctx.groups.world)  # every role has loaded its model
        ctx.log.info("setup done in %.1fs", time.perf_counter() - t0)
        return follower.serve_until(lambda: ctx.store.check([END_KEY.format(restart=ctx.ident.restart)]))
    if role == "generator":
        from hpc_rl.roles.generator import GeneratorRole

        server = GeneratorRole(ctx, routes)
        server.join_refit()
    elif role.startswith("teacher/"):
        from transformers import AutoTokenizer

        from hpc_rl.roles.teacher import TeacherRole

        server = TeacherRole(ctx, routes, role.split("/", 1)[1], AutoTokenizer.from_pretrained(ctx.cfg.model.path))
    elif role == "env":
        from hpc_rl.roles.env import EnvRole

        server = EnvRole(ctx, routes)
    else:
        raise RuntimeError(f"role {role!r} has no part in run.program=rl")
    dist.barrier(group=ctx.groups.world)  # every role has loaded its model
    ctx.log.info("setup done in %.1fs", time.perf_counter() - t0)
    result = server.serve()
    if result.get("idle"):
        wait_for_end(ctx)
    return result


def announce_end(ctx) -> None:
    ctx.store.set(END_KEY.format(restart=ctx.ident.restart), "1")


def wait_for_end(ctx) -> None:
    """An idle rank (nothing routed to it) waits for the run's end on the store, not in a
    collective whose timeout a long run would exceed."""
    key = END_KEY.format(restart=ctx.ident.restart)
    ctx.set_phase("wait_end", None)  # nothing is routed to this rank
    while not ctx.store.check([key]):
        time.sleep(IDLE_POLL_S)


def domains_for_refit(ctx, routes: Routes) -> Optional[Dict[int, str]]:
    """Refit layout rank -> NVLink domain, from the placement made at rendezvous (trainer
    ranks first, then engine g's workers: refit/engine_group.py refit_setup); None when the
    placement has no domains."""
    placement = getattr(ctx, "placement", None)
    if placement is None or not getattr(placement, "roles", None):
        return None
    trainer_role = ctx.plan.roles[0].name
    tp = ctx.plan.role("generator").parallel["tp"]
    per_task = max(tp // routes.engine_tasks, 1)  # an engine's workers per task
    ranks = [(trainer_role, i) for i in range(len(routes.trainer))] + \
            [("generator", g * routes.engine_tasks + j // per_task) for g in range(len(routes.generators)) for j in range(tp)]
    out: Dict[int, str] = {}
    for layout_rank, (role, role_rank) in enumerate(ranks):
        rp = placement.roles.get(role)
        if rp is None:
            return None
        segment = (role_rank // ctx.plan.role(role).tasks_per_node) // rp.segment_size
        if segment >= len(rp.segment_domains):
            return None
        out[layout_rank] = rp.segment_domains[segment]
    return out

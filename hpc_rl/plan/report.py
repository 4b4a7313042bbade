"""A readable table of a JobPlan, as the dry run prints it."""

from __future__ import annotations

from typing import List

from hpc_rl.config.resources import REFERENCE, reference_checkpoint, reference_on_trainer
from hpc_rl.config.schema import RunConfig

from .job_plan import JobPlan
from .memory_report import memory_table

_COLUMNS = ["role", "nodes", "gpus/node", "tasks/node", "tp", "cp", "ep", "pp", "dp", "segment"]


def plan_table(plan: JobPlan) -> str:
    rows: List[List[str]] = []
    for r in plan.roles:
        p = r.parallel
        rows.append([r.name, str(r.nodes), str(r.gpus_per_node), str(r.tasks_per_node),
                     str(p["tp"]), str(p["cp"]), str(p["ep"]), str(p["pp"]), str(p["dp"]), str(r.segment_size)])
    rows.append(["total", str(plan.total_nodes), "", "", "", "", "", "", "", ""])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(_COLUMNS)]

    def fmt(cells: List[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join([first, *rest]).rstrip()

    rule = "-" * len(fmt(_COLUMNS))
    lines = [fmt(_COLUMNS), rule, *(fmt(r) for r in rows[:-1]), rule, fmt(rows[-1])]
    return "\n".join(lines)


def routing_table(cfg: RunConfig, plan: JobPlan) -> str:
    group_of = {alias: g for g, aliases in plan.teacher_aliases.items() for alias in aliases}
    lines = []
    if cfg.teachers:
        lines.append(f"routing (default: {cfg.routing.default}{', strict' if cfg.routing.strict else ''}):")
    for alias in cfg.teachers:
        agents = cfg.routing.agents.get(alias, [])
        default = "  + unlisted agents" if alias == cfg.routing.default and not cfg.routing.strict else ""
        lines.append(f"  {alias:<12} -> teacher/{group_of[alias]:<12} {', '.join(agents) or '-'}{default}")
    if REFERENCE in group_of:  # algo.ref_kl_coef > 0: every training sample, whatever its agent
        lines.append(f"reference model ({reference_checkpoint(cfg)}) -> teacher/{group_of[REFERENCE]}: every training "
                     f"sample (algo.ref_kl_coef={cfg.algo.ref_kl_coef}, {cfg.algo.ref_kl.estimator} in the "
                     f"{cfg.algo.ref_kl.apply_to})")
    elif reference_on_trainer(cfg):  # trainer.lora: the base with the adapters off, no rank group of its own
        lines.append(f"reference model ({cfg.model.path}, the student's base with the LoRA adapters off) -> the trainer "
                     f"ranks: every training sample (algo.ref_kl_coef={cfg.algo.ref_kl_coef}, "
                     f"{cfg.algo.ref_kl.estimator} in the {cfg.algo.ref_kl.apply_to})")
    return "\n".join(lines)


def describe(cfg: RunConfig, plan: JobPlan) -> str:
    head = f"{plan.recipe} on {plan.cluster}: {plan.total_nodes} nodes, {plan.total_gpus} GPUs, {len(plan.roles)} roles"
    parts = [head, "", plan_table(plan)]
    routing = routing_table(cfg, plan)
    if routing:
        parts += ["", routing]
    if plan.memory is not None:
        parts += ["", memory_table(plan.memory, plan.cluster)]
    return "\n".join(parts)

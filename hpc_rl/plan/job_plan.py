"""RunConfig -> JobPlan: the roles of one job, their nodes, tasks and parallel layouts.

The plan is what every later layer reads (the sbatch renderer, the rank runtime, the
refit planner), and what `plan.json` records in each run directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hpc_rl.config.resources import derived_dp, derived_segment, gpus_per_node, role_sections, tasks_per_node, teacher_groups
from hpc_rl.config.schema import RunConfig

from .memory_plan import memory_doc

TEACHER_PREFIX = "teacher/"


def role_config_key(role: str) -> str:
    """The config section of a role, for errors that name the key to change: trainer ->
    trainer, teacher/<group> -> teachers.<group> (config/resources.py role_sections names
    roles so; tests/test_placement.py checks the two agree)."""
    if role.startswith(TEACHER_PREFIX):
        return "teachers." + role[len(TEACHER_PREFIX):]
    return role


@dataclass(frozen=True)
class RolePlan:
    name: str  # trainer | generator | teacher/<alias> | env
    nodes: int
    gpus_per_node: int
    tasks_per_node: int
    parallel: Dict[str, int]  # tp, cp, ep, pp, dp
    segment_size: int

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def tasks_per_replica(self) -> int:
        """Tasks one model replica spans (a vLLM engine's tasks for the generator): tasks / dp."""
        return max(self.tasks // max(self.parallel.get("dp", 1), 1), 1)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class JobPlan:
    recipe: str
    cluster: str
    roles: List[RolePlan]
    # teacher group name -> the aliases it serves (aliases sharing a checkpoint share one)
    teacher_aliases: Dict[str, List[str]] = field(default_factory=dict)
    # each role's bytes per GPU (plan/memory_plan.py memory_doc); None: not planned
    memory: Optional[dict] = None

    @property
    def total_nodes(self) -> int:
        return sum(r.nodes for r in self.roles)

    @property
    def total_gpus(self) -> int:
        return sum(r.gpus for r in self.roles)

    def role(self, name: str) -> RolePlan:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(f"no role {name!r} in the plan (roles: {[r.name for r in self.roles]})")

    def to_dict(self) -> dict:
        """The plan.json document."""
        return {
            "recipe": self.recipe,
            "total_nodes": self.total_nodes,
            "roles": [
                {
                    "name": r.name,
                    "nodes": r.nodes,
                    "gpus_per_node": r.gpus_per_node,
                    "tasks_per_node": r.tasks_per_node,
                    "parallel": dict(r.parallel),
                    "segment_size": r.segment_size,
                }
                for r in self.roles
            ],
            **({"memory": self.memory} if self.memory is not None else {}),
        }

    @classmethod
    def from_dict(cls, doc: dict) -> "JobPlan":
        """Read plan.json back (the job side reads the plan, never re-plans)."""
        roles = [RolePlan(name=r["name"], nodes=r["nodes"], gpus_per_node=r["gpus_per_node"], tasks_per_node=r["tasks_per_node"],
                          parallel=dict(r["parallel"]), segment_size=r["segment_size"]) for r in doc["roles"]]
        return cls(recipe=doc["recipe"], cluster=doc.get("cluster", ""), roles=roles, memory=doc.get("memory"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


def build_plan(cfg: RunConfig) -> JobPlan:
    """Plan a validated config (hpc_rl.config.compose.load_config validates)."""
    roles = []
    for name, _key, role in role_sections(cfg):
        p = role.parallel
        roles.append(
            RolePlan(
                name=name,
                nodes=role.nodes,
                gpus_per_node=gpus_per_node(role, cfg.cluster),
                tasks_per_node=tasks_per_node(role, cfg.cluster),
                parallel={"tp": p.tp, "cp": p.cp, "ep": p.ep, "pp": p.pp, "dp": derived_dp(role, cfg.cluster)},
                segment_size=derived_segment(role, cfg.cluster),
            )
        )
    aliases = {g.name: list(g.aliases) for g in teacher_groups(cfg)}
    return JobPlan(recipe=cfg.recipe or "", cluster=cfg.cluster.name, roles=roles, teacher_aliases=aliases,
                   memory=memory_doc(cfg))

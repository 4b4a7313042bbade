"""What a role's config implies: its devices, derived data parallelism, spans and segment.

Pure arithmetic on the schema, shared by validation and the planner so both read the
same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from .schema import ClusterConfig, GeneratorConfig, RoleResources, RunConfig, TeacherConfig, TrainerConfig


def gpus_per_node(role: RoleResources, cluster: ClusterConfig) -> int:
    return cluster.gpus_per_node if role.gpus_per_node is None else role.gpus_per_node


def tasks_per_node(role: RoleResources, cluster: ClusterConfig) -> int:
    """One task per GPU on GPU nodes; one task per node on CPU-only nodes unless set."""
    if role.tasks_per_node is not None:
        return role.tasks_per_node
    return max(gpus_per_node(role, cluster), 1)


def devices_per_node(role: RoleResources, cluster: ClusterConfig) -> int:
    """GPUs on GPU nodes; CPU ranks (tasks) where the role has no GPU."""
    g = gpus_per_node(role, cluster)
    return g if g > 0 else tasks_per_node(role, cluster)


def world_size(role: RoleResources, cluster: ClusterConfig) -> int:
    return role.nodes * devices_per_node(role, cluster)


def engine_workers_per_task(role: GeneratorConfig, cluster: ClusterConfig) -> int:
    """Workers of one vLLM engine (tp*pp in all) that one generator task hosts. GPU: the
    task's GPUs (one by default). CPU: one core per worker at least, so the largest divisor
    of tp*pp that the task's cores allow (at least 1)."""
    workers = role.parallel.tp * role.parallel.pp
    g = gpus_per_node(role, cluster)
    if g > 0:
        return max(g // max(tasks_per_node(role, cluster), 1), 1)
    cores = cpus_per_task(role, cluster)
    return max([d for d in range(1, workers + 1) if workers % d == 0 and d <= cores] or [1])


def engine_tasks(role: GeneratorConfig, cluster: ClusterConfig) -> int:
    """Consecutive generator tasks one vLLM engine spans. Its first task runs the engine
    (scheduler and its workers), the others host the rest of its workers (vLLM's multi-node
    multiprocessing executor: each task is one of its nodes)."""
    return ceil_div(role.parallel.tp * role.parallel.pp, engine_workers_per_task(role, cluster))


def replica_tasks(role: RoleResources, cluster: ClusterConfig) -> int:
    """Tasks one model replica spans: tp*cp*pp, except for a vLLM engine, whose tasks may
    each host several of its workers (engine_tasks)."""
    p = role.parallel
    if isinstance(role, GeneratorConfig):
        return engine_tasks(role, cluster) * p.cp
    return p.tp * p.cp * p.pp


def replica_label(role: RoleResources, cluster: ClusterConfig) -> str:
    if isinstance(role, GeneratorConfig):
        w = role.parallel.tp * role.parallel.pp
        return f"engine tasks (tp*pp = {w} workers, {engine_workers_per_task(role, cluster)} per task)"
    return "tp*cp*pp"


def cpus_per_task(role: RoleResources, cluster: ClusterConfig) -> int:
    """The cores one task of a CPU role owns: the node's cores split between its tasks."""
    return cluster.cpus_per_node // max(tasks_per_node(role, cluster), 1)


def derived_dp(role: RoleResources, cluster: ClusterConfig) -> Optional[int]:
    """dp as given, or tasks / (the tasks of one replica) when that divides; None when it
    cannot be derived. For the generator dp is its number of engines."""
    p = role.parallel
    if p.dp is not None:
        return p.dp
    model = replica_tasks(role, cluster)
    world = world_size(role, cluster)
    if model <= 0 or world % model:
        return None
    return world // model


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ep_span_nodes(role: RoleResources, cluster: ClusterConfig) -> int:
    """Nodes one expert-parallel group covers: EP groups take consecutive ranks (expert
    tensor parallel innermost), so a group of etp*ep ranks spans that many GPUs."""
    return ceil_div(role.parallel.ep * role.parallel.etp, devices_per_node(role, cluster))


def instance_span_nodes(role: RoleResources, cluster: ClusterConfig) -> int:
    """Nodes one model replica covers (replica_tasks): a vLLM instance, a teacher replica."""
    return ceil_div(replica_tasks(role, cluster), devices_per_node(role, cluster))


def derived_segment(role: RoleResources, cluster: ClusterConfig) -> int:
    """The segment (nodes kept in one NVLink domain / leaf switch) when the recipe gives none:
    trainer: its EP span; generator: one instance; teacher: the whole group; env: 1."""
    if role.segment_size is not None:
        return role.segment_size
    if isinstance(role, TrainerConfig):
        return max(ep_span_nodes(role, cluster), 1)
    if isinstance(role, GeneratorConfig):
        return max(instance_span_nodes(role, cluster), ep_span_nodes(role, cluster), 1)
    if isinstance(role, TeacherConfig):
        return role.nodes
    return 1


# The reference model's alias among the teachers' (reserved: no teacher may take it).
REFERENCE = "reference"


@dataclass
class TeacherGroup:
    """One rank group serving every alias that names the same checkpoint."""

    name: str  # the first alias in definition order
    aliases: List[str]
    config: TeacherConfig
    key: str = ""  # its config section: teachers.<name>, or reference

    @property
    def serves_reference(self) -> bool:
        return REFERENCE in self.aliases


def reference_on_trainer(cfg: RunConfig) -> bool:
    """algo.ref_kl_coef > 0 with trainer.lora: the reference is the student's base with the adapters
    off, scored by the trainer ranks themselves (roles/trainer.py), no teacher group, no second copy."""
    return cfg.algo.ref_kl_coef > 0 and cfg.trainer.lora.enabled


def reference_checkpoint(cfg: RunConfig) -> Optional[str]:
    """The checkpoint a teacher group serves as the reference model, when the run has one
    (algo.ref_kl_coef > 0 without LoRA: reference_on_trainer), else None."""
    if cfg.algo.ref_kl_coef <= 0 or reference_on_trainer(cfg):
        return None
    return cfg.reference.checkpoint or cfg.model.path


def teacher_groups(cfg: RunConfig) -> List[TeacherGroup]:
    """The inference-only rank groups: one per distinct teacher checkpoint, in definition order,
    then the reference model's, unless a teacher has its checkpoint (that group serves both)."""
    by_ckpt: Dict[str, TeacherGroup] = {}
    for alias, teacher in cfg.teachers.items():
        group = by_ckpt.get(teacher.checkpoint)
        if group is None:
            by_ckpt[teacher.checkpoint] = TeacherGroup(alias, [alias], teacher, f"teachers.{alias}")
        else:
            group.aliases.append(alias)
    ref = reference_checkpoint(cfg)
    if ref is not None:
        if ref in by_ckpt:
            by_ckpt[ref].aliases.append(REFERENCE)
        else:
            by_ckpt[ref] = TeacherGroup(REFERENCE, [REFERENCE], cfg.reference, REFERENCE)
    return list(by_ckpt.values())


def group_config(cfg: RunConfig, name: str) -> TeacherConfig:
    """The resources and checkpoint of the teacher group `name` (a teacher alias or the reference)."""
    for g in teacher_groups(cfg):
        if g.name == name:
            return g.config
    raise KeyError(f"no teacher group {name!r}")


def role_sections(cfg: RunConfig) -> List[tuple]:
    """(role name, config key, resources) in het-component order."""
    roles = [("trainer", "trainer", cfg.trainer), ("generator", "generator", cfg.generator)]
    roles += [(f"teacher/{g.name}", g.key, g.config) for g in teacher_groups(cfg)]
    roles.append(("env", "env", cfg.env))
    return roles

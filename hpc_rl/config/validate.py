"""Rules that span fields. Every rule appends violations; none stops the others.

Each violation names the key, the value and the fix, so a user can correct a 224-node
recipe in one edit instead of one resubmission per mistake.
"""

from __future__ import annotations

import fnmatch
from typing import Callable, List

from .errors import Violation, check_positive
from .resources import (
    derived_dp,
    derived_segment,
    devices_per_node,
    ep_span_nodes,
    gpus_per_node,
    instance_span_nodes,
    replica_label,
    replica_tasks,
    role_sections,
    tasks_per_node,
    REFERENCE,
    teacher_groups,
    world_size,
)
from .schema import GeneratorConfig, RoleResources, RunConfig
from .validate_agentic import check_agentic
from .validate_algo import check_algo_options
from .validate_async import check_in_flight
from .validate_data import check_validation
from .validate_ft import check_ft
from .validate_generator import check_generator
from .validate_logging import check_logging
from .validate_lora import check_lora
from .validate_memory import check_memory
from .validate_memory_plan import check_memory_keys
from .validate_packing import check_attention, check_packing
from .validate_rundir import check_run_dir


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _short(values: List[int], limit: int = 12) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (", ..." if len(values) > limit else "")


def check_role(out: List[Violation], cfg: RunConfig, key: str, role: RoleResources) -> None:
    cluster = cfg.cluster
    p = role.parallel
    ok = check_positive(out, f"{key}.nodes", role.nodes)
    for name in ("tp", "cp", "ep", "pp", "etp"):
        ok &= check_positive(out, f"{key}.parallel.{name}", getattr(p, name))
    if p.dp is not None:
        ok &= check_positive(out, f"{key}.parallel.dp", p.dp)
    gpn = gpus_per_node(role, cluster)
    if gpn < 0 or gpn > max(cluster.gpus_per_node, 0):
        out.append(Violation(f"{key}.gpus_per_node", gpn, f"the cluster {cluster.name!r} has {cluster.gpus_per_node} GPUs per node",
                             f"set {key}.gpus_per_node between 0 and {cluster.gpus_per_node}, or pick another cluster="))
        ok = False
    tpn = tasks_per_node(role, cluster)
    if tpn < 1:
        out.append(Violation(f"{key}.tasks_per_node", tpn, "must be at least 1", f"set {key}.tasks_per_node >= 1"))
        ok = False
    elif gpn > 0 and tpn != gpn:
        out.append(Violation(f"{key}.tasks_per_node", tpn, f"GPU roles run one task per GPU ({gpn} per node)",
                             f"remove {key}.tasks_per_node or set it to {gpn}"))
    if not ok:
        return

    world = world_size(role, cluster)
    unit = "GPUs" if gpn > 0 else "CPU ranks"
    model = replica_tasks(role, cluster)  # tp*cp*pp; a CPU vLLM engine's tp workers share its one task
    label = replica_label(role, cluster)
    short = label.split(" ")[0]
    if p.dp is not None and model * p.dp != world:
        out.append(Violation(f"{key}.parallel", f"tp={p.tp} cp={p.cp} pp={p.pp} dp={p.dp}",
                             f"{short}*dp = {model * p.dp} but the role has {world} {unit} ({role.nodes} nodes x {world // role.nodes})",
                             f"make {short}*dp = {world}, or leave {key}.parallel.dp unset to derive it"))
        return
    if world % model:
        out.append(Violation(f"{key}.parallel", f"tp={p.tp} cp={p.cp} pp={p.pp}",
                             f"{label} = {model} does not divide the role's {world} {unit}",
                             f"give the generator a multiple of {model} tasks ({key}.nodes x tasks per node) or a smaller tp"
                             if key == "generator" else
                             f"choose {short} among the divisors of {world} ({_short(_divisors(world))}) or change {key}.nodes"))
        return

    # The expert mesh (etp x ep x edp) tiles each pipeline stage's ranks.
    per_stage = world // p.pp
    if per_stage % (p.ep * p.etp):
        fits = [d for d in _divisors(per_stage // p.etp)]
        out.append(Violation(f"{key}.parallel.ep", p.ep,
                             f"expert parallel x expert tensor parallel ({p.ep}x{p.etp}) must divide the {per_stage} {unit} of a pipeline stage (tp*cp*dp)",
                             f"set {key}.parallel.ep to a divisor of {per_stage // p.etp}: {_short(fits)}"))
        return
    if cfg.model.num_experts and key in ("trainer", "generator") and cfg.model.num_experts % p.ep:
        out.append(Violation(f"{key}.parallel.ep", p.ep, f"the model has {cfg.model.num_experts} experts, which EP {p.ep} does not split evenly",
                             f"set {key}.parallel.ep to a divisor of {cfg.model.num_experts}"))

    dpn = devices_per_node(role, cluster)
    span = ep_span_nodes(role, cluster)
    if p.ep * p.etp > dpn and (p.ep * p.etp) % dpn:
        out.append(Violation(f"{key}.parallel.ep", p.ep, f"an EP group of {p.ep * p.etp} ranks would cover part of a node ({dpn} per node)",
                             f"make ep*etp a multiple of {dpn} or at most {dpn}"))
    elif role.nodes % span:
        out.append(Violation(f"{key}.parallel.ep", p.ep, f"an EP group spans {span} nodes, which does not divide the role's {role.nodes} nodes",
                             f"set {key}.nodes to a multiple of {span} or choose another ep"))

    seg = derived_segment(role, cluster)
    seg_key = f"{key}.segment_size"
    if seg < 1:
        out.append(Violation(seg_key, seg, "must be at least 1", f"set {seg_key} >= 1 or leave it unset to derive it"))
        return
    if role.nodes % seg:
        out.append(Violation(seg_key, seg, f"segments of {seg} nodes do not divide the role's {role.nodes} nodes",
                             f"set {seg_key} to a divisor of {role.nodes}: {_short(_divisors(role.nodes))}"))
    if cluster.topology == "block" and seg > cluster.usable_nodes_per_domain:
        out.append(Violation(seg_key, seg,
                             f"a segment must fit in one NVLink domain ({cluster.usable_nodes_per_domain} usable nodes "
                             f"of {cluster.nvlink_domain_nodes} on {cluster.name})",
                             f"set {seg_key} <= {cluster.usable_nodes_per_domain} (and shrink the EP span or instance size to match)"))
    if cluster.topology == "tree" and cluster.leaf_switch_nodes and seg > cluster.leaf_switch_nodes:
        out.append(Violation(seg_key, seg, f"a segment must fit under one leaf switch ({cluster.leaf_switch_nodes} nodes on {cluster.name})",
                             f"set {seg_key} <= {cluster.leaf_switch_nodes}"))
    if span > 1 and seg % span:
        out.append(Violation(seg_key, seg, f"an EP group spans {span} nodes and must sit inside one segment",
                             f"set {seg_key} to a multiple of {span}"))
    if cluster.topology == "block" and span > cluster.usable_nodes_per_domain:
        out.append(Violation(f"{key}.parallel.ep", p.ep,
                             f"an EP group spans {span} nodes, more than one NVLink domain ({cluster.usable_nodes_per_domain} usable nodes)",
                             f"keep ep*etp <= {cluster.usable_nodes_per_domain * dpn} on {cluster.name}"))
    if isinstance(role, GeneratorConfig):
        inst = instance_span_nodes(role, cluster)
        if inst > 1 and seg % inst:
            out.append(Violation(seg_key, seg, f"one vLLM instance (tp*pp = {p.tp * p.pp}) spans {inst} nodes and must sit inside one segment",
                                 f"set {seg_key} to a multiple of {inst}"))


def check_trainer(out: List[Violation], cfg: RunConfig) -> None:
    t = cfg.trainer
    cl = cfg.cluster
    if t.backend == "megatron" and cl.gpus_per_node == 0:
        out.append(Violation("trainer.backend", t.backend, "Megatron-core's forward path needs CUDA; this cluster has no GPUs "
                             f"(cluster.gpus_per_node=0 on {cl.name})",
                             "use trainer.backend=fsdp2 on CPU clusters, or a GPU cluster (cluster=gb200_nvl72, cluster=h100)"))
    if t.sequence_parallel and t.parallel.tp == 1:
        out.append(Violation("trainer.sequence_parallel", True, "sequence parallelism splits along tensor parallel ranks and needs tp > 1",
                             "set trainer.sequence_parallel=false or trainer.parallel.tp > 1"))
    check_positive(out, "trainer.max_seq_len", t.max_seq_len)
    check_positive(out, "trainer.micro_batch_size", t.micro_batch_size)
    check_positive(out, "trainer.global_batch_size", t.global_batch_size)
    check_positive(out, "trainer.max_nonfinite_steps", t.max_nonfinite_steps, minimum=0)  # 0: the first one fails
    check_memory(out, t)  # trainer.logprob_chunk_tokens / logprob_batch_tokens (validate_memory.py)
    check_packing(out, cfg)  # trainer.packing / micro_batch_tokens (validate_packing.py)
    check_attention(out, cfg)  # trainer.attn_implementation (validate_packing.py)
    cp, tp = t.parallel.cp, t.parallel.tp
    if cp > 1 and t.max_seq_len > 0:
        # Context parallel load-balances causal attention by cutting sequences into 2*cp chunks;
        # sequence parallel further splits each chunk over tp ranks.
        unit = 2 * cp * (tp if t.sequence_parallel else 1)
        if t.max_seq_len % unit:
            out.append(Violation("trainer.max_seq_len", t.max_seq_len,
                                 f"with cp={cp}{' and sequence parallel tp=' + str(tp) if t.sequence_parallel else ''} "
                                 f"sequences are cut into multiples of {unit} tokens",
                                 f"set trainer.max_seq_len to a multiple of {unit}"))
    dp = derived_dp(t, cl)
    if dp and t.micro_batch_size > 0 and t.global_batch_size % (dp * t.micro_batch_size):
        out.append(Violation("trainer.global_batch_size", t.global_batch_size,
                             f"must divide by data parallel x micro batch = {dp} x {t.micro_batch_size} = {dp * t.micro_batch_size}",
                             f"set trainer.global_batch_size to a multiple of {dp * t.micro_batch_size}"))
    o = t.optimizer
    if o.lr <= 0:
        out.append(Violation("trainer.optimizer.lr", o.lr, "must be positive", "set trainer.optimizer.lr > 0"))
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        out.append(Violation("trainer.optimizer.betas", o.betas, "must be two numbers in [0, 1)", "e.g. trainer.optimizer.betas=[0.9,0.999]"))
    if o.eps <= 0:
        out.append(Violation("trainer.optimizer.eps", o.eps, "must be positive", "e.g. trainer.optimizer.eps=1e-8"))
    if o.weight_decay < 0:
        out.append(Violation("trainer.optimizer.weight_decay", o.weight_decay, "must be >= 0", "set trainer.optimizer.weight_decay >= 0"))
    if o.grad_clip <= 0:
        out.append(Violation("trainer.optimizer.grad_clip", o.grad_clip, "must be positive", "set trainer.optimizer.grad_clip > 0"))
    s = t.scheduler
    if s.warmup_steps < 0:
        out.append(Violation("trainer.scheduler.warmup_steps", s.warmup_steps, "must be >= 0", "set trainer.scheduler.warmup_steps >= 0"))
    if s.warmup_start_lr < 0 or (o.lr > 0 and s.warmup_start_lr > o.lr):
        out.append(Violation("trainer.scheduler.warmup_start_lr", s.warmup_start_lr, f"must lie in [0, optimizer.lr = {o.lr}]",
                             "set trainer.scheduler.warmup_start_lr <= trainer.optimizer.lr"))


def check_teachers_and_routing(out: List[Violation], cfg: RunConfig) -> None:
    aliases = list(cfg.teachers)
    r = cfg.routing
    if cfg.algo.name == "mopd" and not aliases:
        out.append(Violation("teachers", {}, "MOPD needs at least one teacher", "define teachers.<alias>.checkpoint in the recipe"))
    for alias, t in cfg.teachers.items():
        if not t.checkpoint:
            out.append(Violation(f"teachers.{alias}.checkpoint", t.checkpoint, "every teacher needs a checkpoint",
                                 f"set teachers.{alias}.checkpoint to a model path or name"))
    for group in teacher_groups(cfg):
        for alias in group.aliases[1:]:
            other = cfg.reference if alias == REFERENCE else cfg.teachers[alias]
            for fld in ("nodes", "gpus_per_node", "tasks_per_node", "parallel", "precision", "segment_size"):
                mine, theirs = getattr(other, fld), getattr(group.config, fld)
                if mine == theirs:
                    continue
                why = (f"alias {alias!r} shares checkpoint {group.config.checkpoint!r} with {group.name!r}, "
                       f"so they share one rank group, but {fld} differs")
                if alias != REFERENCE:
                    out.append(Violation(f"teachers.{alias}.{fld}", mine, why,
                                         f"set teachers.{alias}.{fld} to {theirs!r} or give it its own checkpoint"))
                elif mine is not None:  # the reference's precision None: its group's
                    out.append(Violation(f"reference.{fld}", mine, why,
                                         f"set reference.{fld} to {theirs!r} or give the reference its own checkpoint"))
    if not aliases:
        return
    if r.default is None:
        if not r.strict:
            out.append(Violation("routing.default", None, "agents that no slot lists need a default teacher",
                                 f"set routing.default to one of {aliases}, or routing.strict=true"))
    elif r.default not in cfg.teachers:
        out.append(Violation("routing.default", r.default, f"is not a defined teacher (teachers: {aliases})",
                             f"set routing.default to one of {aliases} or define teachers.{r.default}"))
    seen = {}
    for alias, agents in r.agents.items():
        if alias not in cfg.teachers:
            out.append(Violation(f"routing.agents.{alias}", agents, f"routes to {alias!r}, which is not a defined teacher (teachers: {aliases})",
                                 f"define teachers.{alias} or move these agents under one of {aliases}"))
        for agent in agents:
            for prev_pattern, prev_alias in seen.items():
                if prev_alias != alias and (fnmatch.fnmatchcase(agent, prev_pattern) or fnmatch.fnmatchcase(prev_pattern, agent)):
                    out.append(Violation(f"routing.agents.{alias}", agent,
                                         f"is also routed to {prev_alias!r} (by {prev_pattern!r}); each sample is scored by exactly one teacher",
                                         f"list {agent!r} under one alias only"))
            seen[agent] = alias


def check_algo(out: List[Violation], cfg: RunConfig) -> None:
    a = cfg.algo
    check_positive(out, "algo.prompts_per_step", a.prompts_per_step)
    check_positive(out, "algo.generations_per_prompt", a.generations_per_prompt)
    if a.name == "grpo" and a.generations_per_prompt < 2:
        out.append(Violation("algo.generations_per_prompt", a.generations_per_prompt,
                             "GRPO normalises rewards within a prompt's group and needs at least 2 generations",
                             "set algo.generations_per_prompt >= 2"))
    rollouts = a.prompts_per_step * a.generations_per_prompt
    gbs = cfg.trainer.global_batch_size
    if gbs > 0 and rollouts > 0 and rollouts % gbs:
        out.append(Violation("algo.prompts_per_step", a.prompts_per_step,
                             f"prompts x generations = {rollouts} rollouts per step is not a whole number of trainer batches ({gbs})",
                             f"make algo.prompts_per_step * algo.generations_per_prompt a multiple of trainer.global_batch_size={gbs}"))
    if a.opd.adv_clip <= 0:
        out.append(Violation("algo.opd.adv_clip", a.opd.adv_clip, "must be positive", "e.g. algo.opd.adv_clip=20"))
    if a.loss.ratio_clip_low < 0 or a.loss.ratio_clip_high < 0:
        out.append(Violation("algo.loss", f"low={a.loss.ratio_clip_low} high={a.loss.ratio_clip_high}", "ratio clip bounds must be >= 0",
                             "set algo.loss.ratio_clip_low/high >= 0"))
    m = a.mismatch
    if m.kind != "none" and not (0 <= m.min <= 1.0 <= m.max):
        out.append(Violation("algo.mismatch", f"min={m.min} max={m.max}", "importance-weight bounds must satisfy 0 <= min <= 1 <= max",
                             "e.g. algo.mismatch.min=0.2 algo.mismatch.max=5.0"))
    if m.seq_logprob_error_threshold is not None and m.seq_logprob_error_threshold <= 1.0:
        out.append(Violation("algo.mismatch.seq_logprob_error_threshold", m.seq_logprob_error_threshold,
                             "the mean multiplicative probability error is >= 1, so a threshold <= 1 masks every sequence",
                             "set it above 1 (e.g. 2.0) or to null"))
    if a.ref_kl_coef < 0:
        out.append(Violation("algo.ref_kl_coef", a.ref_kl_coef, "must be >= 0", "set algo.ref_kl_coef >= 0"))
    check_algo_options(out, cfg)
    asy = a.async_rollout
    if asy.max_trajectory_age_steps < 0:
        out.append(Violation("algo.async_rollout.max_trajectory_age_steps", asy.max_trajectory_age_steps, "must be >= 0",
                             "set it to 0 (on-policy) or more"))
    if asy.enabled and m.kind == "none":
        out.append(Violation("algo.mismatch.kind", "none", "asynchronous rollouts train on samples of older weights; "
                             "without an importance-sampling correction the update is biased",
                             "set algo.mismatch.kind=tis (or icepop), or algo.async_rollout.enabled=false"))
    if asy.enabled and asy.max_trajectory_age_steps == 0:
        out.append(Violation("algo.async_rollout.max_trajectory_age_steps", 0, "asynchronous rollouts sample step k+1 "
                             "while step k trains, so every sample is 1 step old: a bound of 0 drops them all",
                             "set algo.async_rollout.max_trajectory_age_steps=1 or more (or enabled=false)"))
    check_in_flight(out, asy)


def check_job(out: List[Violation], cfg: RunConfig) -> None:
    if cfg.recipe is None:
        out.append(Violation("recipe", None, "no recipe chosen", "add +recipe=<name> (see recipes/recipe/)"))
    sizes = [r.nodes for _, _, r in role_sections(cfg) if r.nodes > 0]
    # Slurm never places two components of one het job on the same node, shared nodes or not
    # (a 7-node job on the 6-node local cluster pends forever); cluster=local has no max_nodes.
    total = sum(sizes)
    if cfg.cluster.max_nodes is not None and total > cfg.cluster.max_nodes:
        out.append(Violation("cluster.max_nodes", cfg.cluster.max_nodes, f"the job needs {total} nodes",
                             "lower the roles' nodes or choose a larger cluster="))
    cl = cfg.cluster
    if check_positive(out, "cluster.nvlink_domain_nodes", cl.nvlink_domain_nodes) and \
            check_positive(out, "cluster.usable_nodes_per_domain", cl.usable_nodes_per_domain) and \
            cl.usable_nodes_per_domain > cl.nvlink_domain_nodes:
        # segments are sized by the usable nodes; more of them than the domain has is a typo
        out.append(Violation("cluster.nvlink_domain_nodes", cl.nvlink_domain_nodes,
                             f"an NVLink domain cannot have fewer nodes than its {cl.usable_nodes_per_domain} usable ones",
                             "set cluster.nvlink_domain_nodes >= cluster.usable_nodes_per_domain"))
    ck = cfg.checkpoint
    check_positive(out, "checkpoint.every_steps", ck.every_steps)
    check_positive(out, "checkpoint.keep_last", ck.keep_last)
    if ck.keep_every is not None:
        check_positive(out, "checkpoint.keep_every", ck.keep_every)
    check_positive(out, "run.max_steps", cfg.run.max_steps)


def check_data(out: List[Violation], cfg: RunConfig) -> None:
    from hpc_rl.data.tasks import GENERATORS  # light: plain Python

    d = cfg.data
    if d.path is None:
        if not d.tasks:
            out.append(Violation("data.tasks", d.tasks, "no dataset: data.path is unset and no task is listed",
                                 "set data.path=/path/to/prompts.jsonl or data.tasks=[addition_1digit]"))
        for i, t in enumerate(d.tasks):
            if t not in GENERATORS:
                out.append(Violation(f"data.tasks[{i}]", t, "unknown synthetic task", f"choose from {sorted(GENERATORS)}"))
        check_positive(out, "data.samples_per_task", d.samples_per_task)
    if d.eval_prompts_per_task < 0:
        out.append(Violation("data.eval_prompts_per_task", d.eval_prompts_per_task, "must be >= 0", "0 turns evaluation off"))
    check_validation(out, cfg)  # data.validation.*, checkpoint keep-best (validate_data.py)


def check_launch(out: List[Violation], cfg: RunConfig) -> None:
    image = cfg.container.image
    if image is not None and image.endswith(".sqsh") and not image.startswith(("/", "./")):
        # pyxis reads anything else as a registry image name and tries to pull it
        out.append(Violation("container.image", image, "a squashfs image path must start with '/' or './' (pyxis treats other names as registry images)",
                             f"use an absolute path or container.image=./{image}"))
    for i, mount in enumerate(cfg.container.mounts):
        if ":" not in mount or not mount.split(":", 1)[0].startswith("/"):
            out.append(Violation(f"container.mounts[{i}]", mount, "a mount is SRC:DST[:FLAGS] with an absolute SRC",
                                 "e.g. /lustre:/lustre"))
    s = cfg.launcher.slurm
    if s.signal_grace_s < 0:
        out.append(Violation("launcher.slurm.signal_grace_s", s.signal_grace_s, "must be >= 0", "set it to the seconds a checkpoint save needs"))
    if cfg.run.rendezvous_timeout_s < 1:
        out.append(Violation("run.rendezvous_timeout_s", cfg.run.rendezvous_timeout_s, "must be >= 1", "e.g. run.rendezvous_timeout_s=300"))
    check_ft(out, cfg)  # ft.*: failure injection, heartbeats, the progress watchdog, requeues (validate_ft.py)
    if cfg.refit.timeout_s <= 0:
        out.append(Violation("refit.timeout_s", cfg.refit.timeout_s, "must be > 0 (a refit without a deadline can hang the job)",
                             "e.g. refit.timeout_s=120"))
    if cfg.refit.bucket_mb < 1:
        out.append(Violation("refit.bucket_mb", cfg.refit.bucket_mb, "must be >= 1", "e.g. refit.bucket_mb=64"))


RULES: List[Callable[[List[Violation], RunConfig], None]] = [
    check_job,
    check_trainer,
    check_generator,
    check_teachers_and_routing,
    check_algo,
    check_data,
    check_launch,
    check_logging,
    check_agentic,
    check_run_dir,
    check_memory_keys,
    check_lora,
]


def validate(cfg: RunConfig) -> List[Violation]:
    out: List[Violation] = []
    for _name, key, role in role_sections(cfg):
        check_role(out, cfg, key, role)
    for rule in RULES:
        rule(out, cfg)
    return out

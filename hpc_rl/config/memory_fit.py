"""Whether each role fits its GPUs' memory, and which settings would make it fit.

Launches refuse a role that does not fit (launchers/runnable.py check_runnable: launcher=local|slurm,
`--batch-plan`, pipelines); the dry run prints the table and lists these the way it lists
settings this version cannot run (the flagship's dry run on a cluster it does not fit still shows
its plan). A fix is never guessed: each candidate change (recompute, more context/tensor/expert
parallel ranks, more nodes, smaller micro-batches or chunks, the generator's share and batch) is
applied to a copy of the config, validated like the original, and kept only when the memory
model says the role then fits. Single changes first, then pairs.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, List, Optional, Sequence, Tuple

from hpc_rl.memory.model import GiB, RoleMemory, budget, role_memory

from .errors import Violation
from .memory_inputs import RoleInput, role_inputs, usable_bytes
from .resources import gpus_per_node, teacher_groups
from .schema import RunConfig

Change = Tuple[Tuple[str, Any], ...]  # (dotted key, value) settings applied together
MAX_FIXES = 3


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def _set(cfg: RunConfig, key: str, value: Any) -> None:
    obj: Any = cfg
    parts = key.split(".")
    for part in parts[:-1]:
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    setattr(obj, parts[-1], value)


def _sections(cfg: RunConfig, item: RoleInput) -> List[str]:
    """The config sections a change of the role's layout must touch: a teacher group's every alias."""
    if not item.role.startswith("teacher/"):
        return [item.key]
    for g in teacher_groups(cfg):
        if g.key == item.key:
            return ["reference" if a == "reference" else f"teachers.{a}" for a in g.aliases]
    return [item.key]


def _scaled(cfg: RunConfig, item: RoleInput, sections: List[str]) -> List[Change]:
    """More ranks of one parallel kind, or more nodes, for the role's sections."""
    role = cfg.generator if item.role == "generator" else (cfg.trainer if item.role == "trainer" else None)
    if role is None:
        from .resources import group_config

        role = group_config(cfg, item.role.split("/", 1)[1])
    p, out = role.parallel, []
    gpn = max(gpus_per_node(role, cfg.cluster), 1)
    experts = cfg.model.num_experts or 0
    fsdp2 = cfg.trainer.backend == "fsdp2" and item.role != "generator"
    if item.role == "generator":  # vLLM's expert parallel spans the engine's TP workers (ep = tp)
        out.append(tuple((f"generator.parallel.{k}", p.tp * 2) for k in (("tp", "ep") if p.ep > 1 else ("tp",))))
    else:
        if not (fsdp2 and (p.tp > 1 or p.ep > 1)):
            out += [tuple((f"{s}.parallel.cp", p.cp * f) for s in sections) for f in (2, 4)]
        if p.tp * 2 <= gpn and not (fsdp2 and (p.cp > 1 or p.ep > 1)):
            out.append(tuple((f"{s}.parallel.tp", p.tp * 2) for s in sections))
        if experts and not (fsdp2 and (p.tp > 1 or p.cp > 1)):
            out += [tuple((f"{s}.parallel.ep", p.ep * f) for s in sections) for f in (2, 4) if experts % (p.ep * f) == 0]
    out.append(tuple((f"{s}.nodes", role.nodes * 2) for s in sections))
    return out


def candidates(cfg: RunConfig, item: RoleInput) -> List[Change]:
    """Changes that lower the role's memory, least disruptive first."""
    t, g = cfg.trainer, cfg.generator
    out: List[Change] = []
    if item.role == "trainer":
        # on megatron trainer.activation_checkpointing is full recompute of every layer (unless
        # trainer.megatron.recompute_* asks for it already, which the two keys may not both do);
        # megatron-core 0.16's MambaStack has none (models/megatron/memory.py refuses it), so a
        # hybrid model with Mamba layers is not offered it there
        mamba = item.shape is not None and item.shape.count("M") > 0
        megatron_can = t.megatron.recompute_granularity == "none" and not mamba
        if not t.activation_checkpointing and (t.backend == "fsdp2" or megatron_can):
            out.append((("trainer.activation_checkpointing", True),))
        if t.packing and (t.micro_batch_tokens or 0) > t.max_seq_len:
            out.append((("trainer.micro_batch_tokens", t.max_seq_len),))
        if not t.packing and t.micro_batch_size > 1:
            out.append((("trainer.micro_batch_size", 1),))
    if t.backend == "fsdp2" and item.role != "generator":
        if t.logprob_chunk_tokens == 0:
            out.append((("trainer.logprob_chunk_tokens", None),))
        elif t.logprob_chunk_tokens is None or t.logprob_chunk_tokens > 256:
            out.append((("trainer.logprob_chunk_tokens", 256),))
        if t.logprob_batch_tokens == 0 or (t.logprob_batch_tokens or 0) > t.max_seq_len:
            out.append((("trainer.logprob_batch_tokens", t.max_seq_len),))
    if item.role == "generator":
        out += [(("generator.gpu_memory_utilization", u),) for u in (0.9, 0.95) if u > g.gpu_memory_utilization]
        if g.kv_cache_dtype == "auto":
            out.append((("generator.kv_cache_dtype", "fp8"),))
        out += [(("generator.max_num_seqs", n),) for n in sorted({max(g.max_num_seqs // 8, 1), 1}, reverse=True)
                if n < g.max_num_seqs]
    if item.role == "trainer" and t.backend == "fsdp2" and not t.cpu_offload:
        out.append((("trainer.cpu_offload", True),))
    if item.role == "trainer" and t.backend == "megatron" and not t.megatron.optimizer_cpu_offload:
        out.append((("trainer.megatron.optimizer_cpu_offload", True),))
    return out + _scaled(cfg, item, _sections(cfg, item))


def _problems(cfg: RunConfig) -> set:
    from .support import unsupported
    from .validate import validate

    return {(v.key, v.problem) for v in validate(cfg) + unsupported(cfg)}


def _memory_after(cfg: RunConfig, item: RoleInput, change: Change, known: set) -> Optional[Tuple[int, int]]:
    """(required, budget) of the role with `change` applied, or None when the change makes the
    config invalid (a layout the GPUs or the runtime do not allow)."""
    trial = copy.deepcopy(cfg)
    try:
        for key, value in change:
            _set(trial, key, value)
    except (AttributeError, KeyError):
        return None
    if _problems(trial) - known:
        return None
    again = next((i for i in role_inputs(trial) if i.role == item.role), None)
    if again is None or again.shape is None:
        return None
    limit = budget(again.setup, usable_bytes(trial))
    return role_memory(again.shape, again.setup).required, limit


def fixes(cfg: RunConfig, item: RoleInput) -> List[Tuple[Change, int, int]]:
    """Up to MAX_FIXES changes after which the role fits, with what it then needs and may use."""
    known = _problems(cfg)
    singles = candidates(cfg, item)
    found: List[Tuple[Change, int, int]] = []
    for combo in [(c,) for c in singles] + list(itertools.combinations(singles, 2)):
        if len(combo) == 2 and found and len(found[0][0]) < 2:
            break  # a single change is enough: pairs only when none is
        keys = [k for c in combo for k, _ in c]
        if len(set(keys)) < len(keys):
            continue
        after = _memory_after(cfg, item, tuple(kv for c in combo for kv in c), known)
        if after is not None and after[1] is not None and after[0] <= after[1]:
            found.append((tuple(kv for c in combo for kv in c), after[0], after[1]))
            if len(found) == MAX_FIXES:
                break
    return found


def _render(change: Change) -> str:
    def value(v: Any) -> str:
        return "null" if v is None else ("true" if v is True else ("false" if v is False else str(v)))

    return " with ".join(f"{k}={value(v)}" for k, v in change)


def misfit(cfg: RunConfig, item: RoleInput, m: RoleMemory, limit: int) -> Violation:
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in m.parts.items() if v)
    share = (f"generator.gpu_memory_utilization={cfg.generator.gpu_memory_utilization:g} of" if item.role == "generator"
             else f"{1 - cfg.cluster.gpu_memory_headroom:.0%} (cluster.gpu_memory_headroom) of")
    what = ("to start with room for one max_model_len sequence's KV cache" if item.role == "generator"
            else f"at its peak ({m.phase})")
    notes = "".join(f"; {n}" for n in m.notes if not n.startswith("KV cache holds"))
    problem = (f"{item.role} needs {_gib(m.required)} GiB per GPU {what} ({parts}{notes}; shape: {item.source}) "
               f"but may use {_gib(limit)} GiB: {share} {cfg.cluster.gpu_memory_gib:g} GiB on {cfg.cluster.name}")
    found = fixes(cfg, item)
    if found:
        fix = "set one of: " + "; ".join(f"{_render(c)} (needs {_gib(need)} of {_gib(room)} GiB)"
                                         for c, need, room in found)
    else:
        fix = (f"no single change, nor two together, of {sorted({k for c in candidates(cfg, item) for k, _ in c})} "
               "fits: give the role more GPUs or GPUs with more memory (cluster.gpu_memory_gib)")
    return Violation(item.key, f"{_gib(m.required)} GiB per GPU", problem, fix)


def memory_misfits(cfg: RunConfig, roles: Sequence[str] = ()) -> List[Violation]:
    """A violation per role that does not fit (none where cluster.gpu_memory_gib is unknown or a
    role's shape is); `roles` limits the check to those roles."""
    usable = usable_bytes(cfg)
    out = []
    for item in role_inputs(cfg):
        if item.shape is None or (roles and item.role not in roles):
            continue
        limit = budget(item.setup, usable)
        m = role_memory(item.shape, item.setup)
        if limit is not None and m.required > limit:
            out.append(misfit(cfg, item, m, limit))
    return out


def render_misfits(violations: List[Violation]) -> str:
    """The dry run's listing: the plan is shown, but a launch would refuse these roles."""
    if not violations:
        return ""
    head = (f"roles that do not fit their GPUs' memory ({len(violations)}; launcher=local|slurm refuses them, "
            "the dry run only lists them):")
    return head + "\n" + "\n".join(f"  - {v.render()}" for v in violations)

"""A RunConfig as the memory model's inputs: each role's model shape and settings.

The one place that reads config keys for memory planning (hpc_rl/memory/ is arithmetic only).
The planner (plan/job_plan.py: plan.json, the dry run's table) and the fit check
(config/memory_fit.py) both call `role_inputs`; config/trace.py counts its reads for its caller.

Shapes: a checkpoint's own config.json when it can be read here (model.path, a teacher's
checkpoint), else `model.shape` (the recipe's estimates), and the input says which. Checkpoint
references that are not yet directories (`tiny:<name>`, built on first use) have no shape at
plan time unless model.shape gives one.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from hpc_rl.memory.model import GiB, Setup
from hpc_rl.memory.shape import Shape, ShapeError, from_hf

from .resources import derived_dp, gpus_per_node, role_sections
from .schema import GeneratorConfig, RunConfig, TrainerConfig

# models/fsdp2.py DEFAULT_LOGPROB_BATCH_TOKENS: an unset trainer.logprob_batch_tokens
# (tests/test_memory_model.py holds the two equal)
DEFAULT_LOGPROB_BATCH_TOKENS = 16384
# vLLM's kv_cache_dtype -> bytes per element (auto: the model's dtype)
KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "bfloat16": 2, "float16": 2, "half": 2, "float": 4,
                  "float32": 4}


@dataclass(frozen=True)
class RoleInput:
    role: str  # trainer | generator | teacher/<group>
    key: str  # its config section: trainer, generator, teachers.<alias>, reference
    setup: Setup
    shape: Optional[Shape]
    source: str  # where the shape came from, or why there is none


def recompute_offload(t: TrainerConfig) -> Tuple[bool, bool]:
    """(recompute, offload) of the student's backend: the one place they are read.

    fsdp2: trainer.activation_checkpointing (torch's checkpoint per decoder block) and
    trainer.cpu_offload (FSDP2's CPU offload of parameters, gradients and optimizer state).
    megatron: trainer.megatron.recompute_granularity == "full" (every layer's input kept, the
    rest recomputed; "selective" recomputes core attention, which flash attention never stores,
    so it counts as none) and trainer.megatron.optimizer_cpu_offload.

    trainer.activation_checkpointing asks either backend for it (on megatron: full recompute of
    every layer, models/megatron/memory.py)."""
    if t.backend == "megatron":
        m = t.megatron
        return t.activation_checkpointing or m.recompute_granularity == "full", bool(m.optimizer_cpu_offload)
    return bool(t.activation_checkpointing), bool(t.cpu_offload)


def shape_section(cfg: RunConfig) -> Optional[dict]:
    """model.shape (with model.architecture and model.num_experts) as a config.json-like mapping;
    None when no size is set."""
    fields = {f.name: getattr(cfg.model.shape, f.name) for f in dataclasses.fields(cfg.model.shape)}
    if all(v is None for k, v in fields.items() if k != "tie_word_embeddings"):
        return None
    out = {k: v for k, v in fields.items() if v is not None}
    out["model_type"] = cfg.model.architecture
    if cfg.model.num_experts:  # the family's own name for it (memory/shape.py reads each)
        out["n_routed_experts"] = out["num_experts"] = cfg.model.num_experts
        out.setdefault("n_shared_experts", 1 if cfg.model.shape.moe_shared_expert_intermediate_size else 0)
    return out


def checkpoint_config(path: Optional[str]) -> Optional[dict]:
    """A checkpoint directory's config.json, when it is one on this machine."""
    if not path or ":" in path.split("/")[0]:  # tiny:<name> and the like: built later
        return None
    f = Path(path) / "config.json"
    return json.loads(f.read_text()) if f.is_file() else None


def model_shape(cfg: RunConfig, checkpoint: Optional[str], who: str) -> Tuple[Optional[Shape], str]:
    """The shape of `checkpoint` and where it came from (or why there is none)."""
    hf = checkpoint_config(checkpoint)
    if hf is not None:
        try:
            return from_hf(hf), f"{checkpoint}/config.json"
        except ShapeError as e:
            return None, f"{checkpoint}/config.json: {e}"
    section = shape_section(cfg)
    if section is None:
        return None, f"no shape: {who} {checkpoint or 'unset'} has no readable config.json here and model.shape is unset"
    try:
        return from_hf(section), "model.shape (planning estimates)"
    except ShapeError as e:
        return None, f"model.shape: {e}"


def _logprob_tokens(cfg: RunConfig, rows: int) -> int:
    """Tokens of one no-grad log-prob forward: fsdp2 forwards of logprob_batch_tokens padded tokens
    (whole rows, one at least; 0: all `rows`), packed rows of that many with packing; megatron
    micro_batch_size rows."""
    t = cfg.trainer
    if t.backend == "megatron":
        return t.micro_batch_size * t.max_seq_len
    budget = DEFAULT_LOGPROB_BATCH_TOKENS if t.logprob_batch_tokens is None else t.logprob_batch_tokens
    if budget == 0:
        return max(rows, 1) * t.max_seq_len
    if t.packing:
        return max(budget, t.max_seq_len)
    return max(1, budget // t.max_seq_len) * t.max_seq_len


def train_tokens(t: TrainerConfig) -> int:
    """Tokens of one train micro-batch on one data-parallel rank: micro_batch_tokens packed
    (default max_seq_len), else micro_batch_size rows of max_seq_len."""
    if t.packing:
        return t.micro_batch_tokens or t.max_seq_len
    return t.micro_batch_size * t.max_seq_len


def gpu_bytes(cfg: RunConfig) -> Optional[int]:
    g = cfg.cluster.gpu_memory_gib
    return int(g * GiB) if g else None


def usable_bytes(cfg: RunConfig) -> Optional[int]:
    """What the trainer and teachers may plan for on one GPU (None: unknown)."""
    total = gpu_bytes(cfg)
    return int(total * (1 - cfg.cluster.gpu_memory_headroom)) if total else None


def _lora_params(shape: Shape, lora) -> int:
    """trainer.lora's adapter parameters; unset target modules: the dense families' default names
    (memory/lora.py counts a name only where the shape has such a linear, so an MoE model's
    fused experts count nothing, as peft adapts none of them)."""
    from hpc_rl.memory.lora import adapter_params
    from hpc_rl.models.families.spec import ATTENTION_LINEARS, GATED_MLP_LINEARS

    return adapter_params(shape, lora.rank, lora.target_modules or ATTENTION_LINEARS + GATED_MLP_LINEARS)


def role_inputs(cfg: RunConfig) -> List[RoleInput]:
    """Every model-holding role (env ranks hold none), in plan order."""
    t, cl = cfg.trainer, cfg.cluster
    recompute, offload = recompute_offload(t)
    rollouts = cfg.algo.prompts_per_step * cfg.algo.generations_per_prompt
    out = []
    for name, key, role in role_sections(cfg):
        if name == "env":
            continue
        p = role.parallel
        dp = derived_dp(role, cl) or 1
        parallel: Dict[str, int] = {"tp": p.tp, "cp": p.cp, "ep": p.ep, "etp": p.etp, "pp": p.pp, "dp": dp}
        device = "gpu" if gpus_per_node(role, cl) > 0 else "cpu"
        if name == "trainer":
            setup = Setup(kind="trainer", backend=t.backend, precision=t.precision, parallel=parallel, device=device,
                          sequence_parallel=t.sequence_parallel, train_tokens=train_tokens(t),
                          logprob_tokens=_logprob_tokens(cfg, -(-rollouts // dp)), chunk_tokens=t.logprob_chunk_tokens,
                          recompute=recompute, offload=offload)
            shape, source = model_shape(cfg, cfg.model.path, "model.path")
            if shape is not None and t.lora.enabled:
                setup = dataclasses.replace(setup, lora_params=_lora_params(shape, t.lora))
        elif isinstance(role, GeneratorConfig):
            setup = Setup(kind="generator", backend="vllm", precision=role.precision, parallel=parallel, device=device,
                          gpu_memory_utilization=role.gpu_memory_utilization,
                          max_model_len=role.max_model_len or t.max_seq_len, max_num_seqs=role.max_num_seqs,
                          kv_dtype_bytes=KV_DTYPE_BYTES.get(role.kv_cache_dtype, 0),
                          gpu_bytes=gpu_bytes(cfg) if device == "gpu" else None)
            shape, source = model_shape(cfg, cfg.model.path, "model.path")
        else:  # a teacher group (or the reference): inference on trainer.backend
            checkpoint = role.checkpoint or cfg.model.path  # the reference's None: the student's
            # megatron teachers with tp > 1 run sequence parallel (models/megatron/backend.py)
            setup = Setup(kind="teacher", backend=t.backend, precision=role.precision or t.precision, parallel=parallel,
                          device=device, sequence_parallel=t.backend == "megatron" and p.tp > 1,
                          logprob_tokens=_logprob_tokens(cfg, -(-rollouts // dp)), chunk_tokens=t.logprob_chunk_tokens)
            shape, source = model_shape(cfg, checkpoint, f"{key}.checkpoint")
        out.append(RoleInput(role=name, key=key, setup=setup, shape=shape, source=source))
    return out

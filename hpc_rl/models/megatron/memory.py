"""The student's memory savers on the megatron backend, as megatron-core's own arguments.

`trainer.activation_checkpointing` and `trainer.megatron.*` (config/schema_trainer.py) ->
TransformerConfig's recompute fields and OptimizerConfig's offload fields. Pure functions over
the config (no megatron import), so the CPU tests build megatron-core's real dataclasses from
them and a memory model can read the effective settings from one place. What needs the
checkpoint (its layers, MoE or dense, the pipeline split) is `recompute_problems`, which
config_map.check runs before submission (rl/inputs.py) and again at start-up.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

from .hf_mapping import ModelDims
from hpc_rl.models.families.nemotron_h.megatron_mapping import NemotronHDims

# trainer.activation_checkpointing on megatron: every layer recomputed in the backward, as the
# fsdp2 backend's per-block checkpoint does (one layer per recompute group)
FULL_EVERY_LAYER = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def recompute_kwargs(train: Any) -> Dict[str, Any]:
    """TransformerConfig's recompute arguments for the student (`train`: the trainer section);
    empty when nothing is recomputed (megatron-core's defaults: every activation kept).
    Validation refuses activation_checkpointing together with recompute_granularity."""
    m = train.megatron
    if m.recompute_granularity == "none":
        return dict(FULL_EVERY_LAYER) if train.activation_checkpointing else {}
    kw: Dict[str, Any] = {"recompute_granularity": m.recompute_granularity}
    if m.recompute_granularity == "full":
        kw.update(recompute_method=m.recompute_method, recompute_num_layers=m.recompute_num_layers)
    elif m.recompute_modules is not None:  # selective; None keeps megatron-core's default (core_attn)
        kw["recompute_modules"] = list(m.recompute_modules)
    return kw


def optimizer_offload_kwargs(train: Any) -> Dict[str, Any]:
    """OptimizerConfig's offload arguments. The precision-aware optimizer comes with the offload:
    without it the distributed optimizer keeps an fp32 main copy of its shard on the GPU and the
    hybrid optimizer only moves the Adam moments (megatron-core's documented pairing is
    --optimizer-cpu-offload with --use-precision-aware-optimizer); with it the main weights live in
    the hybrid optimizer's fp32 copies, on the host for the offloaded share."""
    m = train.megatron
    if not m.optimizer_cpu_offload:
        return {}
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": float(m.optimizer_offload_fraction),
            "use_precision_aware_optimizer": True}


def offload_problems(train: Any, te: bool) -> List[str]:
    """What a node needs for the optimizer offload: megatron-core 0.16.1's OptimizerConfig reads
    Transformer Engine's version when the precision-aware optimizer is on (is_te_min_version in
    its __post_init__) and fails with a TypeError without TE, offload or not. The launch assumes
    TE (the gpu extra, the container image); the backend checks the node it runs on."""
    if train.megatron.optimizer_cpu_offload and not te:
        return ["trainer.megatron.optimizer_cpu_offload runs megatron-core's precision-aware optimizer, whose config "
                "needs Transformer Engine installed (megatron-core 0.16.1 reads its version): install transformer-engine "
                "(the gpu extra) or set trainer.megatron.optimizer_cpu_offload=false"]
    return []


def recompute_problems(d: ModelDims, pp: int, kw: Mapping[str, Any], te: bool = True) -> List[str]:
    """Reasons these recompute arguments cannot work on this checkpoint split over `pp` stages
    (megatron-core indexes past a stage's layers, or ignores a module the model does not have);
    empty when they do. `te`: Transformer Engine's layer specs (assumed before submission)."""
    out: List[str] = []
    granularity = kw.get("recompute_granularity")
    if granularity == "full":
        if isinstance(d, NemotronHDims):
            out.append("megatron-core 0.16's MambaStack (Nemotron-H) has no full recompute: it would keep every "
                       "activation; use trainer.megatron.recompute_granularity=selective or none")
        stage = d.num_layers // pp if pp and d.num_layers % pp == 0 else None
        n = kw.get("recompute_num_layers")
        if stage and n:
            if kw.get("recompute_method") == "uniform" and stage % n:
                out.append(f"trainer.megatron.recompute_num_layers={n} must divide the {stage} layers of a pipeline stage "
                           f"({d.num_layers} layers / pp {pp}) with recompute_method=uniform")
            if kw.get("recompute_method") == "block" and n > stage:
                out.append(f"trainer.megatron.recompute_num_layers={n} is more than the {stage} layers of a pipeline "
                           f"stage ({d.num_layers} layers / pp {pp})")
    if granularity == "selective":
        modules = set(kw.get("recompute_modules") or ["core_attn"])
        has_moe = bool(d.num_experts and d.moe_layers)
        dense = (d.pattern.count("-") if isinstance(d, NemotronHDims) else d.num_layers - len(d.moe_layers)) > 0
        need = {"moe": (has_moe, "an MoE model"), "moe_act": (has_moe, "an MoE model"),
                "shared_experts": (bool(getattr(d, "shared_ffn", 0)), "shared experts in its MoE layers"),
                "mlp": (dense, "dense MLP layers")}
        if te:  # TE's layer specs fuse a dense layer's norms into its linear layers (IdentityOp norms)
            need["layernorm"] = (has_moe, "MoE layers (under Transformer Engine a dense layer's norms are fused "
                                          "into its linear layers; an MoE layer's pre-MLP norm is separate)")
        if "moe_act" in modules and has_moe and not te:
            out.append("trainer.megatron.recompute_modules has 'moe_act', which megatron-core runs with Transformer "
                       "Engine's grouped GEMM only (install transformer-engine, or leave moe_act out)")
        for module in sorted(modules):
            ok, what = need.get(module, (True, ""))
            if not ok:
                out.append(f"trainer.megatron.recompute_modules has {module!r}, which needs {what}; this {d.arch} "
                           f"checkpoint has none, so megatron-core would recompute nothing for it")
    return out

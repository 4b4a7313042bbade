"""Qwen2 (HF `Qwen2ForCausalLM`): a Llama-style decoder with biases on q/k/v. The biases
split with their column-parallel weights (fsdp2's ColwiseParallel, vLLM's QKVParallelLinear),
so the Llama plan and layout serve it unchanged; megatron maps the biases (qkv_bias)."""

from __future__ import annotations

from ..spec import Family, MegatronTraits, TensorParallelPlan
from .tiny import Qwen2ModelSpec

FAMILY = Family(name="qwen2", label="Qwen2", architectures=("Qwen2ForCausalLM",),
                megatron=MegatronTraits(qkv_bias=True), tp_plan=TensorParallelPlan(), test_model=Qwen2ModelSpec())

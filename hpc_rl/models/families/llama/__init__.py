"""Llama (HF `LlamaForCausalLM`): the Llama-style decoder every other dense family extends:
column-parallel q/k/v and gate/up, row-parallel o/down, vLLM's fused qkv_proj / gate_up_proj
(refit/vllm_layout.py's common rules), megatron-core's GPT mapping. The tiny test models
(`tiny:<name>`) are Llamas (tiny.py)."""

from __future__ import annotations

from ..spec import ATTENTION_LINEARS, GATED_MLP_LINEARS, Family, MegatronTraits, TensorParallelPlan
from .tiny import ModelSpec

FAMILY = Family(name="llama", label="Llama", architectures=("LlamaForCausalLM",),
                megatron=MegatronTraits(), tp_plan=TensorParallelPlan(), tiny=("tiny",), lora_targets=ATTENTION_LINEARS + GATED_MLP_LINEARS,
                test_model=ModelSpec(hidden=64, intermediate=192, layers=2, heads=2, max_positions=256))

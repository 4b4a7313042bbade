"""Llama (HF `LlamaForCausalLM`): the Llama-style decoder every other dense family extends:
column-parallel q/k/v and gate/up, row-parallel o/down, vLLM's fused qkv_proj / gate_up_proj
(refit/vllm_layout.py's common rules), megatron-core's GPT mapping. The tiny test models
(`tiny:<name>`) are Llamas (tiny.py)."""

from __future__ import annotations

from ..spec import Family, MegatronTraits, TensorParallelPlan

FAMILY = Family(name="llama", label="Llama", architectures=("LlamaForCausalLM",),
                megatron=MegatronTraits(), tp_plan=TensorParallelPlan(), tiny=("tiny",))

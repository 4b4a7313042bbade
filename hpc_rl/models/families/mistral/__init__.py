"""Mistral (HF `MistralForCausalLM`, model_type mistral): a Llama-style decoder (grouped-query
attention, SwiGLU, RMSNorm, no biases); the older checkpoints add a sliding attention window,
which transformers and vLLM both read from config.json (`sliding_window`).

- fsdp2: the Llama plan (column-parallel q/k/v and gate/up, row-parallel o/down).
- vLLM (models/mistral.py, a subclass of its Llama): fused qkv_proj and gate_up_proj with
  the same packed_modules_mapping and stacked-parameter names as Llama, so the common refit
  rules (refit/vllm_layout.py) serve it.
- megatron: not converted here (no mapping written for it yet).
- tests: a tiny random Mistral (tiny.py)."""

from __future__ import annotations

from ..spec import Family, TensorParallelPlan
from .tiny import MistralModelSpec

FAMILY = Family(name="mistral", label="Mistral", architectures=("MistralForCausalLM",),
                tp_plan=TensorParallelPlan(), test_model=MistralModelSpec())

"""Mistral (HF `MistralForCausalLM`, model_type mistral): a Llama-style decoder (grouped-query
attention, SwiGLU, RMSNorm, no biases); the older checkpoints add a sliding attention window,
which transformers and vLLM both read from config.json (`sliding_window`).

- fsdp2: the Llama plan (column-parallel q/k/v and gate/up, row-parallel o/down). Context
  parallel refused: its attention applies no sliding window (Mistral 7B v0.1: 4096).
- vLLM (models/mistral.py, a subclass of its Llama): fused qkv_proj and gate_up_proj with
  the same packed_modules_mapping and stacked-parameter names as Llama, so the common refit
  rules (refit/vllm_layout.py) serve it.
- megatron: not converted here (no mapping written for it yet).
- tests: a tiny random Mistral (tiny.py)."""

from __future__ import annotations

from ..spec import ATTENTION_LINEARS, GATED_MLP_LINEARS, Family, TensorParallelPlan
from .tiny import MistralModelSpec

FAMILY = Family(name="mistral", label="Mistral", architectures=("MistralForCausalLM",),
                tp_plan=TensorParallelPlan(), context_parallel=False,
                parallel_refusal="the fsdp2 context-parallel attention applies no sliding window (config.json's "
                                 "sliding_window, which Mistral checkpoints may set)",
                test_model=MistralModelSpec(), lora_targets=ATTENTION_LINEARS + GATED_MLP_LINEARS)

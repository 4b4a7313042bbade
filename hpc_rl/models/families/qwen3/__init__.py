"""Qwen3 (HF `Qwen3ForCausalLM`, dense): a Llama-style decoder with per-head RMS norms on q and
k (`self_attn.q_norm` / `k_norm`, weight [head_dim]) and no q/k/v biases.

- fsdp2: the Llama plan, plus the head norms: they run on the column-parallel q/k outputs, a
  rank's own heads, so their input is marked sharded over heads and their weight's gradient is
  summed over the tp ranks (models/parallel/tensor_parallel.py `_head_norms`).
- vLLM (models/qwen3.py): fused qkv_proj and gate_up_proj as for Llama; q_norm / k_norm whole
  on every TP rank (refit/vllm_layout.py's common rules replicate them: not a projection).
- megatron: converts it (qk_norm).
- tests: a tiny random Qwen3 (tiny.py)."""

from __future__ import annotations

from ..spec import Family, MegatronTraits, TensorParallelPlan
from .tiny import Qwen3ModelSpec

FAMILY = Family(name="qwen3", label="Qwen3", architectures=("Qwen3ForCausalLM",),
                megatron=MegatronTraits(qk_norm=True),
                tp_plan=TensorParallelPlan(head_norms=("self_attn.q_norm", "self_attn.k_norm")),
                test_model=Qwen3ModelSpec())

"""Qwen3 (HF `Qwen3ForCausalLM`): a Llama-style decoder with per-head RMS norms on q and k
(`self_attn.q_norm` / `k_norm`, weight [head_dim]) and no q/k/v biases. The megatron
backend converts it (qk_norm)."""

from __future__ import annotations

from ..spec import Family, MegatronTraits

FAMILY = Family(name="qwen3", label="Qwen3", architectures=("Qwen3ForCausalLM",), fsdp2=False,
                megatron=MegatronTraits(qk_norm=True))

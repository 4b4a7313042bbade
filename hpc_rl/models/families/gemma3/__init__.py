"""Gemma 3, text only (HF `Gemma3ForCausalLM`, model_type gemma3_text: gemma-3-1b and the
text tower's checkpoints): a decoder with grouped-query attention, per-head RMS norms on q and
k, four norms per layer (input, post-attention, pre- and post-feed-forward), GeGLU, embeddings
scaled by sqrt(hidden), RMS norms that multiply by (1 + weight), and sliding-window layers
beside global ones (`layer_types`, `sliding_window`; each kind its own rotary base).

- fsdp2: the Llama plan's column/row split, with all four residual-stream norms and the per-head
  q/k norms (as Qwen3's: their input is the rank's own heads, their weight's gradient summed over
  the ranks). The embedding scale is a scalar: it commutes with the vocabulary split. Tied
  embeddings (the released checkpoints) are refused for tp by the common rule
  (models/checkpoint_check.py: the embedding is split by rows, the head by columns); data
  parallel runs them (the tiny model with `tied=True`: 3 GRPO steps, dp 2, into a TP-2 engine at
  token_mult_prob_error 1.0000001, measured once by hand, not in the bench). Context parallel refused: its attention applies no sliding window.
- vLLM (models/gemma3.py): qkv_proj and gate_up_proj fused with Llama's stacked names; q_norm,
  k_norm and the four norms whole on every rank; the same (1 + weight) norms and embedding
  scale, so the common refit rules (refit/vllm_layout.py) serve it.
- Not honoured here, and unset in every Gemma 3 checkpoint: `final_logit_softcapping` and
  `attn_logit_softcapping` (Gemma 2's), which the chunked log-probs do not apply.
- megatron: not converted.
- tests: a tiny random Gemma 3 with one sliding (window 16) and one global layer (tiny.py)."""

from __future__ import annotations

from ..spec import ATTENTION_LINEARS, GATED_MLP_LINEARS, Family, TensorParallelPlan
from .tiny import Gemma3ModelSpec

PLAN = TensorParallelPlan(norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                 "post_feedforward_layernorm"),
                          head_norms=("self_attn.q_norm", "self_attn.k_norm"))

FAMILY = Family(name="gemma3_text", label="Gemma 3", architectures=("Gemma3ForCausalLM",), tp_plan=PLAN,
                context_parallel=False,
                parallel_refusal="the fsdp2 context-parallel attention applies no sliding window, which Gemma 3's "
                                 "local layers need",
                test_model=Gemma3ModelSpec(), lora_targets=ATTENTION_LINEARS + GATED_MLP_LINEARS)

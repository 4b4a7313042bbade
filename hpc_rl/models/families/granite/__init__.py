"""Granite (HF `GraniteForCausalLM`, IBM Granite 3.x dense): a Llama-style decoder with four
scalars from config.json: `embedding_multiplier` (the embeddings' output), `residual_multiplier`
(each block's output before the residual add), `attention_multiplier` (the attention's softmax
scale instead of 1/sqrt(head_dim)) and `logits_scaling` (the logits are divided by it).

- fsdp2: the Llama plan: the three multipliers act on whole or sharded activations alike
  (scalars commute with the splits). `logits_scaling` acts after lm_head, which the chunked
  log-probs run themselves, so the family declares it (`logit_scale`, models/chunked_logprobs.py
  applies it to the hidden states before the head).
- vLLM (models/granite.py): fused qkv_proj and gate_up_proj with Llama's stacked names and
  packed_modules_mapping, so the common refit rules (refit/vllm_layout.py) serve it; it reads
  the same four scalars (its LogitsProcessor scales by 1/logits_scaling).
- megatron: not converted (megatron-core's GPT model has no such multipliers here).
- tests: a tiny random Granite with every scalar away from 1 (tiny.py)."""

from __future__ import annotations

from ..spec import ATTENTION_LINEARS, GATED_MLP_LINEARS, Family, TensorParallelPlan
from .tiny import GraniteModelSpec

FAMILY = Family(name="granite", label="Granite", architectures=("GraniteForCausalLM",),
                tp_plan=TensorParallelPlan(), logit_scale=lambda config: 1.0 / config.get("logits_scaling", 1.0),
                test_model=GraniteModelSpec(), lora_targets=ATTENTION_LINEARS + GATED_MLP_LINEARS)

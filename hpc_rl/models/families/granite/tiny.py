"""The tiny random Granite of the family's tests (tests/test_families.py, bench/logprob_agreement.py
--family granite, bench/families.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GraniteModelSpec:
    hidden: int = 64
    intermediate: int = 192
    layers: int = 2
    heads: int = 2  # head_dim 32: vLLM's CPU attention has no kernel for 16
    kv_heads: int = 2
    max_positions: int = 256
    # Granite's scalars, away from 1 so that a path that drops one moves the log-probs (the
    # 3.x checkpoints use 12 / 0.22 / 1/128 / 8 at their widths). logits_scaling below 1 here:
    # a divisor of 4 flattened this tiny model's logits so far that one training step moved
    # vLLM's stale log-probs by only 1.016 (tests/test_families.py wants a step to show)
    embedding_multiplier: float = 6.0
    residual_multiplier: float = 0.5
    attention_multiplier: float = 0.0625  # instead of 1/sqrt(head_dim) = 0.177
    logits_scaling: float = 0.5

    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first)."""
        from transformers import GraniteConfig, GraniteForCausalLM

        cfg = GraniteConfig(vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
                            num_hidden_layers=self.layers, num_attention_heads=self.heads,
                            num_key_value_heads=self.kv_heads, max_position_embeddings=self.max_positions,
                            embedding_multiplier=self.embedding_multiplier,
                            residual_multiplier=self.residual_multiplier,
                            attention_multiplier=self.attention_multiplier, logits_scaling=self.logits_scaling,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids("<|end|>"),
                            pad_token_id=tok.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
        return GraniteForCausalLM(cfg)

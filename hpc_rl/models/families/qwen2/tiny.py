"""The tiny random Qwen2 of the family's tests (tests/test_families.py, bench/logprob_agreement.py
--family qwen2): q/k/v with biases, grouped-query attention."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Qwen2ModelSpec:
    hidden: int = 64
    intermediate: int = 192
    layers: int = 2
    heads: int = 2  # head_dim 32: vLLM's CPU attention has no kernel for 16
    kv_heads: int = 2  # a tp of 2 keeps whole key/value heads
    max_positions: int = 256

    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first)."""
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
                          num_hidden_layers=self.layers, num_attention_heads=self.heads,
                          num_key_value_heads=self.kv_heads, max_position_embeddings=self.max_positions,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids("<|end|>"),
                          pad_token_id=tok.pad_token_id, tie_word_embeddings=False, use_sliding_window=False,
                          torch_dtype="float32")
        return Qwen2ForCausalLM(cfg)

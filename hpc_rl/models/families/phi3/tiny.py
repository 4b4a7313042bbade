"""The tiny random Phi-3 of the family's tests (tests/test_families.py, bench/logprob_agreement.py
--family phi3, bench/families.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phi3ModelSpec:
    hidden: int = 128
    intermediate: int = 192
    layers: int = 2
    heads: int = 4  # head_dim 32: vLLM's CPU attention has no kernel for 16
    kv_heads: int = 2  # grouped-query (Phi-3-medium, Phi-4): q, k and v of unequal widths in qkv_proj
    max_positions: int = 256

    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first)."""
        from transformers import Phi3Config, Phi3ForCausalLM

        cfg = Phi3Config(vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
                         num_hidden_layers=self.layers, num_attention_heads=self.heads,
                         num_key_value_heads=self.kv_heads, max_position_embeddings=self.max_positions,
                         original_max_position_embeddings=self.max_positions, sliding_window=None,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids("<|end|>"),
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
        return Phi3ForCausalLM(cfg)

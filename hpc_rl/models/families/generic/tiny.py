"""A tiny random Ernie 4.5 (dense): a decoder no family folder describes, which transformers
loads and vLLM serves natively (models/ernie45.py), for the generic path's tests. (It was a
Mistral until Mistral became a family of its own: families/mistral/.)"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenericModelSpec:
    hidden: int = 64
    intermediate: int = 192
    layers: int = 2
    heads: int = 2  # head_dim 32: vLLM's CPU attention has no kernel for 16
    kv_heads: int = 1  # grouped-query attention
    max_positions: int = 256

    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first)."""
        from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

        cfg = Ernie4_5Config(vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
                             num_hidden_layers=self.layers, num_attention_heads=self.heads,
                             num_key_value_heads=self.kv_heads, head_dim=self.hidden // self.heads,
                             max_position_embeddings=self.max_positions, use_bias=False,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids("<|end|>"),
                             pad_token_id=tok.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
        return Ernie4_5ForCausalLM(cfg)

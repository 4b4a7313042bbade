"""A tiny random Ernie 4.5 (dense): a decoder no family folder describes, which transformers
loads and vLLM serves natively (models/ernie45.py), for the generic path's tests. (It was a
Mistral until Mistral became a family of its own: families/mistral/.)"""

from __future__ import annotations

from dataclasses import dataclass

from ..tiny_decoder import TinyDecoder


@dataclass(frozen=True)
class GenericModelSpec(TinyDecoder):
    kv_heads: int = 1  # grouped-query attention

    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first)."""
        from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

        cfg = Ernie4_5Config(**self.config_kwargs(vocab_size, tok, head_dim=self.hidden // self.heads, use_bias=False))
        return Ernie4_5ForCausalLM(cfg)

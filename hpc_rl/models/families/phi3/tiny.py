"""The tiny random Phi-3 of the family's tests (tests/test_families.py, bench/logprob_agreement.py
--family phi3, bench/families.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..tiny_decoder import TinyDecoder


@dataclass(frozen=True)
class Phi3ModelSpec(TinyDecoder):
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2  # grouped-query (Phi-3-medium, Phi-4): q, k and v of unequal widths in qkv_proj

    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first)."""
        from transformers import Phi3Config, Phi3ForCausalLM

        cfg = Phi3Config(**self.config_kwargs(vocab_size, tok, original_max_position_embeddings=self.max_positions,
                                              sliding_window=None))
        return Phi3ForCausalLM(cfg)

"""The tiny random Qwen2 of the family's tests (tests/test_families.py, bench/logprob_agreement.py
--family qwen2): q/k/v with biases, grouped-query attention."""

from __future__ import annotations

from dataclasses import dataclass

from ..tiny_decoder import TinyDecoder


@dataclass(frozen=True)
class Qwen2ModelSpec(TinyDecoder):
    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first)."""
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(**self.config_kwargs(vocab_size, tok, use_sliding_window=False))
        return Qwen2ForCausalLM(cfg)

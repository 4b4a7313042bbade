"""The tiny random Qwen3 of the family's tests (tests/test_families.py, bench/logprob_agreement.py
--family qwen3)."""

from __future__ import annotations

from dataclasses import dataclass

from ..tiny_decoder import TinyDecoder


@dataclass(frozen=True)
class Qwen3ModelSpec(TinyDecoder):
    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first)."""
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(**self.config_kwargs(vocab_size, tok, head_dim=self.hidden // self.heads))
        return Qwen3ForCausalLM(cfg)

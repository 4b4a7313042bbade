"""The tiny random Mistral of the family's tests (tests/test_families.py, bench/logprob_agreement.py
--family mistral, bench/families.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..tiny_decoder import TinyDecoder


@dataclass(frozen=True)
class MistralModelSpec(TinyDecoder):
    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first). No sliding window:
        the window (4096 by default) exceeds every sequence here, and the recent Mistrals have none."""
        from transformers import MistralConfig, MistralForCausalLM

        cfg = MistralConfig(**self.config_kwargs(vocab_size, tok, head_dim=self.hidden // self.heads,
                                                 sliding_window=None))
        return MistralForCausalLM(cfg)

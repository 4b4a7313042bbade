"""The tiny random Granite of the family's tests (tests/test_families.py, bench/logprob_agreement.py
--family granite, bench/families.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..tiny_decoder import TinyDecoder


@dataclass(frozen=True)
class GraniteModelSpec(TinyDecoder):
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

        cfg = GraniteConfig(**self.config_kwargs(
            vocab_size, tok, embedding_multiplier=self.embedding_multiplier,
            residual_multiplier=self.residual_multiplier, attention_multiplier=self.attention_multiplier,
            logits_scaling=self.logits_scaling))
        return GraniteForCausalLM(cfg)

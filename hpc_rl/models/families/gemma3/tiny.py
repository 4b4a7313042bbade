"""The tiny random Gemma 3 (text) of the family's tests (tests/test_families.py,
bench/logprob_agreement.py --family gemma3_text, bench/families.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..tiny_decoder import TinyDecoder


@dataclass(frozen=True)
class Gemma3ModelSpec(TinyDecoder):
    hidden: int = 128
    heads: int = 4
    # one sliding-window layer, one global (the 1B-27B checkpoints: five sliding per global);
    # a window shorter than the test sequences, so that a path ignoring it moves the log-probs
    sliding_window: int = 16
    tied: bool = False  # the released checkpoints tie lm_head to the embedding (data parallel only here)

    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first). Untied embeddings by
        default: the fsdp2 tensor-parallel plan splits the embedding by rows and the head by
        columns, and refuses a tied checkpoint (models/checkpoint_check.py tp_problems)."""
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        head_dim = self.hidden // self.heads
        cfg = Gemma3TextConfig(**self.config_kwargs(
            vocab_size, tok, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=self.sliding_window,
            layer_types=["sliding_attention", "full_attention"][: self.layers], tie_word_embeddings=self.tied))
        return Gemma3ForCausalLM(cfg)

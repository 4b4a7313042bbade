"""The tiny random Mistral of the family's tests (tests/test_families.py, bench/logprob_agreement.py
--family mistral, bench/families.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MistralModelSpec:
    hidden: int = 64
    intermediate: int = 192
    layers: int = 2
    heads: int = 2  # head_dim 32: vLLM's CPU attention has no kernel for 16
    kv_heads: int = 2
    max_positions: int = 256

    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first). No sliding window:
        the window (4096 by default) exceeds every sequence here, and the recent Mistrals have none."""
        from transformers import MistralConfig, MistralForCausalLM

        cfg = MistralConfig(vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
                            num_hidden_layers=self.layers, num_attention_heads=self.heads,
                            num_key_value_heads=self.kv_heads, head_dim=self.hidden // self.heads, sliding_window=None,
                            max_position_embeddings=self.max_positions, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.convert_tokens_to_ids("<|end|>"), pad_token_id=tok.pad_token_id,
                            tie_word_embeddings=False, torch_dtype="float32")
        return MistralForCausalLM(cfg)

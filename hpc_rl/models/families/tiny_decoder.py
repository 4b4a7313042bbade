"""The shape every family's tiny random test decoder shares (each family's `tiny.py` subclasses it
and builds its own transformers config class from `config_kwargs`). Below the families, like
spec.py: no torch, no hpc_rl imports (transformers is imported by each family's `build`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TinyDecoder:
    hidden: int = 64
    intermediate: int = 192
    layers: int = 2
    heads: int = 2  # head_dim 32: vLLM's CPU attention has no kernel for 16
    kv_heads: int = 2  # a tp of 2 keeps whole key/value heads
    max_positions: int = 256

    def config_kwargs(self, vocab_size: int, tok, **extra) -> dict:
        """The Hugging Face config arguments of this shape with the tiny tokenizer's ids (untied
        embeddings, fp32), plus the family's own `extra` (which win)."""
        return {"vocab_size": vocab_size, "hidden_size": self.hidden, "intermediate_size": self.intermediate,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "max_position_embeddings": self.max_positions,
                "bos_token_id": tok.bos_token_id, "eos_token_id": tok.convert_tokens_to_ids("<|end|>"),
                "pad_token_id": tok.pad_token_id, "tie_word_embeddings": False, "torch_dtype": "float32", **extra}

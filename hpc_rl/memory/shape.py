"""A model's shape as the memory model needs it, and its parameter counts.

Pure Python, no torch: the launcher plans memory before any rank starts. A shape comes from a
Hugging Face config.json (`from_hf`: Llama, Qwen2, Qwen3-MoE, Nemotron-H) or from the recipe's
`model.shape` section (config/memory_inputs.py turns that into the same mapping), so the two
sources share one reader.

Layers are blocks of mixers, one letter per mixer (Nemotron-H's letters): `*` attention, `-`
dense MLP, `E` MoE, `M` Mamba-2. A Llama/Qwen2 decoder layer is the block `*-`, a Qwen3-MoE
layer `*E`, a Nemotron-H layer one letter. Activation checkpointing keeps one input per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Tuple

from hpc_rl.models.hybrid_pattern import BLOCK_LETTERS, MIXERS, read_pattern  # noqa: F401 (importable here)

# transformers 5 writes Nemotron-H's layers as `layers_block_type`, NVIDIA's checkpoints as
# `hybrid_override_pattern` (models/megatron/nemotron_h_mapping.py reads both the same way)


class ShapeError(ValueError):
    def __init__(self, message: str, key: str = ""):
        super().__init__(message)
        self.key = key  # the config.json name that is missing, when one is


@dataclass(frozen=True)
class Shape:
    hidden: int
    vocab: int
    blocks: Tuple[str, ...]  # one string of mixer letters per block (decoder layer)
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    ffn: int = 0  # a dense MLP's width
    gated: bool = True  # SwiGLU (gate, up, down: Llama, Qwen) or not (up, down: Nemotron-H's relu2)
    experts: int = 0  # routed experts per MoE layer
    top_k: int = 0  # routed experts per token
    moe_ffn: int = 0  # a routed expert's width
    shared_ffn: int = 0  # the shared expert's width (0: none)
    latent: int = 0  # the latent MoE's width: experts work in it between two projections (0: none)
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state: int = 0
    groups: int = 0
    conv_kernel: int = 4
    tied: bool = False  # embedding and head share one weight

    def count(self, mixer: str) -> int:
        return sum(b.count(mixer) for b in self.blocks)

    @property
    def mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of a Mamba-2 mixer's conv1d: x, B and C."""
        return self.mamba_inner + 2 * self.groups * self.ssm_state

    @property
    def expert_in(self) -> int:
        """The width routed experts read and write: the latent one, else the hidden size."""
        return self.latent or self.hidden


@dataclass(frozen=True)
class Params:
    """Parameter counts. `dense` holds everything but the routed experts and the embedding and
    head; `embedding` counts both the embedding and the head (once when tied)."""

    dense: int
    experts: int
    embedding: int

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.embedding


def mixer_params(s: Shape, mixer: str) -> Tuple[int, int]:
    """(dense, routed-expert) parameters of one mixer, its norm included."""
    h, mats = s.hidden, 3 if s.gated else 2
    if mixer == "*":
        return h + 2 * h * s.heads * s.head_dim + 2 * h * s.kv_heads * s.head_dim, 0
    if mixer == "-":
        return h + mats * h * s.ffn, 0
    if mixer == "E":
        dense = h + s.experts * h + (2 * h * s.latent if s.latent else 0) + mats * h * s.shared_ffn
        return dense, s.experts * mats * s.expert_in * s.moe_ffn
    if mixer == "M":
        d, heads = s.mamba_inner, s.mamba_heads
        in_proj = h * (2 * d + 2 * s.groups * s.ssm_state + heads)
        conv = s.conv_dim * (s.conv_kernel + 1)  # weight and bias
        return h + in_proj + conv + 3 * heads + d + d * h, 0  # dt_bias, A_log, D; the gated norm; out_proj
    raise ShapeError(f"mixer {mixer!r}: one of {MIXERS}")


def params(s: Shape) -> Params:
    dense = experts = 0
    for block in s.blocks:
        for m in block:
            d, e = mixer_params(s, m)
            dense, experts = dense + d, experts + e
    return Params(dense=dense + s.hidden, experts=experts, embedding=s.vocab * s.hidden * (1 if s.tied else 2))


def _get(cfg: Mapping, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _pattern(cfg: Mapping) -> str:
    pattern, fault = read_pattern(cfg)
    if fault:
        raise ShapeError(fault[1], fault[0])
    return pattern


def _need(cfg: Mapping, *names) -> int:
    value = _get(cfg, *names)
    if value is None:
        raise ShapeError(f"{names[0]} is missing", names[0])
    return int(value)


def from_hf(cfg: Mapping) -> Shape:
    """The shape of a Hugging Face config (config.json's mapping). Raises ShapeError naming
    what is missing."""
    from hpc_rl.models import families

    fam = families.resolve(cfg)  # the generic path reads as a dense decoder
    if fam is None:
        raise ShapeError(f"model_type {cfg.get('model_type')!r}: the memory model knows the families "
                         f"{', '.join(f.name for f in families.FAMILIES)} (hpc_rl/models/families/)")
    kind = fam.shape  # which layer rule the family's config follows
    hidden, heads = _need(cfg, "hidden_size"), _need(cfg, "num_attention_heads")
    common = dict(hidden=hidden, vocab=_need(cfg, "vocab_size"), heads=heads,
                  kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
                  head_dim=int(_get(cfg, "head_dim", default=hidden // max(heads, 1))),
                  tied=bool(cfg.get("tie_word_embeddings", False)))
    if kind == "hybrid":
        pattern = _pattern(cfg)
        moe = "E" in pattern
        return Shape(blocks=tuple(pattern), ffn=int(_get(cfg, "intermediate_size", default=0)), gated=False,
                     experts=_need(cfg, "n_routed_experts") if moe else 0,
                     top_k=_need(cfg, "num_experts_per_tok") if moe else 0,
                     moe_ffn=_need(cfg, "moe_intermediate_size") if moe else 0,
                     shared_ffn=int(_get(cfg, "moe_shared_expert_intermediate_size", default=0))
                     if moe and cfg.get("n_shared_experts") else 0,
                     latent=int(_get(cfg, "moe_latent_size", default=0)) if moe else 0,
                     mamba_heads=_need(cfg, "mamba_num_heads") if "M" in pattern else 0,
                     mamba_head_dim=_need(cfg, "mamba_head_dim") if "M" in pattern else 0,
                     ssm_state=_need(cfg, "ssm_state_size") if "M" in pattern else 0,
                     groups=_need(cfg, "n_groups") if "M" in pattern else 0,
                     conv_kernel=int(_get(cfg, "conv_kernel", default=4)), **common)
    layers = _need(cfg, "num_hidden_layers")
    experts = int(_get(cfg, "num_experts", "num_local_experts", default=0))
    if kind == "sparse_step" and experts:
        # Qwen3-MoE: every decoder_sparse_step-th layer is MoE unless listed in mlp_only_layers
        step, dense = int(_get(cfg, "decoder_sparse_step", default=1)), set(cfg.get("mlp_only_layers") or [])
        blocks = tuple("*E" if i not in dense and (i + 1) % step == 0 else "*-" for i in range(layers))
        return Shape(blocks=blocks, ffn=_need(cfg, "intermediate_size"), experts=experts,
                     top_k=_need(cfg, "num_experts_per_tok"), moe_ffn=_need(cfg, "moe_intermediate_size"), **common)
    return Shape(blocks=("*-",) * layers, ffn=_need(cfg, "intermediate_size"), **common)

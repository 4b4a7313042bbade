"""The model's shape for memory planning (`model.shape`), beside schema.py.

Its comments document the keys like schema.py's do (hpc_rl/config/reference.py reads both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .trace import Traced


@dataclass
class ModelShapeConfig(Traced):
    """The sizes the memory model needs (hpc_rl/memory/, docs/memory.md), named as in a Hugging
    Face config.json. Used only while the checkpoint's own config.json cannot be read (model.path
    unset or not on this machine): when it can, the checkpoint's sizes plan the job and the dry run
    says so. A teacher whose checkpoint cannot be read here is planned with this shape too (the
    dry run names it). All null: no memory figures for such a model. The routed experts per MoE
    layer are model.num_experts; the family (gated MLP or not, layer kinds) is model.architecture."""

    hidden_size: Optional[int] = None  # the residual stream's width
    vocab_size: Optional[int] = None  # tokens of the embedding and the head
    # Decoder layers of a Llama/Qwen2/Qwen3-MoE model (attention + MLP or MoE each); Nemotron-H
    # counts its layers from hybrid_override_pattern.
    num_hidden_layers: Optional[int] = None
    # Nemotron-H's layers, one letter each: M Mamba-2, * attention, - dense MLP, E MoE.
    hybrid_override_pattern: Optional[str] = None
    num_attention_heads: Optional[int] = None  # query heads of an attention layer
    num_key_value_heads: Optional[int] = None  # key/value heads (GQA); null: as many as the query heads
    head_dim: Optional[int] = None  # width of one attention head; null: hidden_size / num_attention_heads
    intermediate_size: Optional[int] = None  # a dense MLP's width
    num_experts_per_tok: Optional[int] = None  # routed experts each token goes to (MoE layers)
    moe_intermediate_size: Optional[int] = None  # one routed expert's width
    moe_shared_expert_intermediate_size: Optional[int] = None  # the shared expert's width (Nemotron-H); null: none
    moe_latent_size: Optional[int] = None  # the latent MoE's width: experts work in it (Nemotron 3); null: none
    mamba_num_heads: Optional[int] = None  # Mamba-2 heads of an M layer
    mamba_head_dim: Optional[int] = None  # width of one Mamba-2 head
    ssm_state_size: Optional[int] = None  # Mamba-2 state per head channel
    n_groups: Optional[int] = None  # Mamba-2 groups of B and C
    conv_kernel: Optional[int] = None  # Mamba-2's causal conv width; null: 4
    tie_word_embeddings: bool = False  # the head shares the embedding's weight

"""`trainer` + a Nemotron-H HF config -> megatron-core's TransformerConfig and MambaModel
arguments (issue #25), and the shape rules megatron-core would assert on later, checked at
once. Plain dicts, tested on CPU against megatron-core's own TransformerConfig dataclass.

How HF's Nemotron-H maps (transformers' modeling_nemotron_h, megatron-core 0.16.1):
  - layers: `hybrid_override_pattern` (M, *, -, E), as MambaModel takes it; no positional
    embedding (Nemotron-H's attention has no RoPE: position_embedding_type "none");
  - Mamba-2: mamba_num_heads, mamba_head_dim, n_groups, ssm_state_size; megatron-core's
    mixer uses a conv of 4 taps, no in/out-projection bias, and a gated RMSNorm over groups,
    so other conv_kernel / mamba_proj_bias values are refused, not run differently;
  - MLP and experts: relu2 (megatron's squared_relu), no gate;
  - router: sigmoid scores, `e_score_correction_bias` as megatron's expert bias (chooses the
    experts, not their weights), top-k weights renormalised (megatron always does so for k > 1:
    norm_topk_prob=false is refused), scaled by routed_scaling_factor, grouped top-k when
    n_group > 1; the latent MoE (`moe_latent_size`) needs Transformer Engine in megatron-core.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

from hpc_rl.models.megatron.hf_mapping import padded_vocab
from .megatron_mapping import NemotronHDims
from hpc_rl.models.megatron.shards import Parallel


def layout_problems(hf: Mapping, d: NemotronHDims, p: Parallel, sequence_parallel: bool, max_seq_len: int,
                    te: bool = True) -> List[str]:
    """Reasons megatron-core would refuse (or compute differently) this Nemotron-H on this mesh."""
    out = []
    if "*" in d.pattern and (d.heads % p.tp or d.kv_heads % p.tp):
        out.append(f"tensor parallel {p.tp} must divide the attention heads ({d.heads}) and key/value heads "
                   f"({d.kv_heads})")
    if d.mamba_heads % (p.tp * p.cp):
        out.append(f"tensor parallel {p.tp} x context parallel {p.cp} must divide the {d.mamba_heads} Mamba heads "
                   "(megatron-core's mixer gives each rank whole heads)")
    if d.groups % p.tp:
        out.append(f"tensor parallel {p.tp} must divide the {d.groups} Mamba groups (n_groups): megatron-core "
                   "asserts ngroups % tp == 0")
    if "-" in d.pattern and d.ffn % p.tp:
        out.append(f"tensor parallel {p.tp} must divide the MLP width {d.ffn}")
    if d.num_layers % p.pp:
        out.append(f"pipeline parallel {p.pp} must divide the {d.num_layers} layers (equal stages)")
    if int(hf.get("conv_kernel", 4)) != 4:
        out.append(f"conv_kernel {hf.get('conv_kernel')}: megatron-core's Mamba mixer builds a conv of 4 taps")
    if hf.get("mamba_proj_bias") or hf.get("use_bias"):
        out.append("mamba_proj_bias / use_bias: megatron-core's Mamba mixer has no in/out projection bias")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        out.append("attention_bias / mlp_bias: this mapping carries no output-projection biases")
    if d.num_experts:
        if d.num_experts % p.ep:
            out.append(f"expert parallel {p.ep} must divide the {d.num_experts} experts")
        if d.moe_ffn % p.etp:
            out.append(f"expert tensor parallel {p.etp} must divide the expert MLP width {d.moe_ffn}")
        if d.shared_ffn and d.shared_ffn % p.tp:
            out.append(f"tensor parallel {p.tp} must divide the shared expert's width {d.shared_ffn}")
        if int(hf.get("num_experts_per_tok", 1)) > 1 and hf.get("norm_topk_prob") is False:
            out.append("norm_topk_prob=false: megatron-core's sigmoid router always renormalises the top-k weights")
        if d.latent and not te:
            out.append("moe_latent_size: megatron-core 0.16.1 builds the latent projections with Transformer Engine "
                       "only (install transformer-engine)")
        if p.tp > 1 and not sequence_parallel:
            out.append("megatron-core requires sequence parallelism for MoE models with tensor parallel > 1: "
                       "set trainer.sequence_parallel=true")
    elif p.ep > 1 or p.etp > 1:
        out.append(f"expert parallel {p.ep} / expert tensor parallel {p.etp} on a dense model: set both to 1")
    if p.cp > 1 and max_seq_len % (2 * p.cp):
        out.append(f"context parallel {p.cp}: trainer.max_seq_len={max_seq_len} must be a multiple of {2 * p.cp}")
    return out


def transformer_kwargs(hf: Mapping, d: NemotronHDims, p: Parallel, sequence_parallel: bool, precision: str,
                       dtypes: Mapping[str, str], te: bool = True, cpu_init: bool = False) -> Dict[str, Any]:
    """TransformerConfig keyword arguments (activation_func by name: 'squared_relu')."""
    kw: Dict[str, Any] = dict(
        num_layers=d.num_layers, hidden_size=d.hidden, num_attention_heads=d.heads, num_query_groups=d.kv_heads,
        kv_channels=d.head_dim, ffn_hidden_size=d.ffn, normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("layer_norm_epsilon", hf.get("rms_norm_eps", 1e-5))),
        gated_linear_unit=False, activation_func="squared_relu", add_bias_linear=False, add_qkv_bias=False,
        is_hybrid_model=True, mamba_state_dim=d.state, mamba_head_dim=d.mamba_head_dim,
        mamba_num_groups=d.groups, mamba_num_heads=d.mamba_heads,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp, context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp,
        sequence_parallel=sequence_parallel and p.tp > 1,
        bf16=precision == "bf16", fp16=precision == "fp16", params_dtype=dtypes[precision],
        pipeline_dtype=dtypes[precision] if p.pp > 1 else None,
        moe_token_dispatcher_type="alltoall", use_cpu_initialization=cpu_init, variable_seq_lengths=True,
        apply_rope_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=te,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    if d.num_experts:
        groups = int(hf.get("n_group") or 1)
        kw.update(
            num_moe_experts=d.num_experts, moe_ffn_hidden_size=d.moe_ffn, moe_router_topk=int(hf["num_experts_per_tok"]),
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=int(hf.get("topk_group") or 1) if groups > 1 else None,
            moe_shared_expert_intermediate_size=d.shared_ffn or None, moe_shared_expert_overlap=False,
            moe_latent_size=d.latent or None,
            # post-training keeps the router as trained: no balancing loss, no bias updates
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_bias_update_rate=0.0,
            moe_grouped_gemm=te, moe_router_dtype="fp32",
        )
    return kw


def model_kwargs(d: NemotronHDims, p: Parallel, max_seq_len: int) -> Dict[str, Any]:
    """MambaModel keyword arguments besides config and the stack spec."""
    return dict(vocab_size=padded_vocab(d.vocab, p.tp), max_sequence_length=max_seq_len,
                hybrid_override_pattern=d.pattern, position_embedding_type="none",
                share_embeddings_and_output_weights=d.tied, parallel_output=True)

"""`trainer` section + Hugging Face config -> the arguments of megatron-core's
TransformerConfig, GPTModel, OptimizerConfig and DistributedDataParallelConfig.

The mapping itself is plain dicts (tested on CPU against megatron-core's own dataclasses,
which import and validate without a GPU); `transformer_config` and `optimizer_config`
import megatron lazily. Every shape rule megatron-core would assert on later (heads over
tp, experts over ep, layers over pp, ...) is checked here first, all at once, so a bad
layout fails at start-up with every reason listed.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from hpc_rl.models.families.nemotron_h import megatron_config as nemotron_h_config
from .hf_mapping import MappingError, ModelDims, padded_vocab
from .memory import optimizer_offload_kwargs, recompute_problems
from hpc_rl.models.families.nemotron_h.megatron_mapping import NemotronHDims, dims_of
from .shards import Parallel

# vLLM's CPU twin and the HF forward use plain attention; so do we unless TE is present.
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def layout_problems(d: ModelDims, p: Parallel, sequence_parallel: bool, max_seq_len: int) -> List[str]:
    """Reasons megatron-core would refuse this model on this mesh (empty: it builds)."""
    out = []
    if d.heads % p.tp or d.kv_heads % p.tp:
        out.append(f"tensor parallel {p.tp} must divide the attention heads ({d.heads}) and the key/value heads "
                   f"({d.kv_heads}): Megatron gives each rank whole query groups")
    if d.ffn % p.tp:
        out.append(f"tensor parallel {p.tp} must divide the MLP width {d.ffn}")
    if d.num_layers % p.pp:
        out.append(f"pipeline parallel {p.pp} must divide the {d.num_layers} layers (equal stages)")
    if d.num_experts:
        if d.num_experts % p.ep:
            out.append(f"expert parallel {p.ep} must divide the {d.num_experts} experts")
        if d.moe_ffn % p.etp:
            out.append(f"expert tensor parallel {p.etp} must divide the expert MLP width {d.moe_ffn}")
        if p.tp > 1 and not sequence_parallel:
            out.append("megatron-core requires sequence parallelism for MoE models with tensor parallel > 1: "
                       "set trainer.sequence_parallel=true")
    elif p.ep > 1 or p.etp > 1:
        out.append(f"expert parallel {p.ep} / expert tensor parallel {p.etp} on a dense model: set both to 1")
    try:
        p.edp
    except MappingError as e:
        out.append(str(e))
    if p.cp > 1 and max_seq_len % (2 * p.cp):
        out.append(f"context parallel {p.cp} splits each sequence into {2 * p.cp} chunks: trainer.max_seq_len="
                   f"{max_seq_len} must be a multiple of {2 * p.cp}")
    return out


def _rope(hf: Mapping) -> Dict[str, Any]:
    """RoPE settings GPTModel takes. transformers 5 keeps them in rope_parameters, 4.x in
    rope_theta / rope_scaling; only plain and llama3-scaled RoPE map onto GPTModel."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rotary_base": int(theta)}
    if kind == "llama3":
        return {"rotary_base": int(theta), "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise MappingError(f"rope type {kind!r} has no GPTModel equivalent in this mapping (plain and llama3 only)")


def transformer_kwargs(hf: Mapping, p: Parallel, sequence_parallel: bool, precision: str,
                       te: bool = True, cpu_init: bool = False) -> Dict[str, Any]:
    """Keyword arguments of megatron.core TransformerConfig (activation_func as a name:
    'silu'; transformer_config() resolves it)."""
    d = dims_of(hf)
    if isinstance(d, NemotronHDims):
        return nemotron_h_config.transformer_kwargs(hf, d, p, sequence_parallel, precision, _DTYPES, te, cpu_init)
    kw: Dict[str, Any] = dict(
        num_layers=d.num_layers, hidden_size=d.hidden, num_attention_heads=d.heads, num_query_groups=d.kv_heads,
        kv_channels=d.head_dim, ffn_hidden_size=d.ffn, normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), gated_linear_unit=True, activation_func="silu",
        add_bias_linear=False, add_qkv_bias=d.qkv_bias, qk_layernorm=d.qk_norm,
        # RL needs the same log-probs for the same tokens: no dropout
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp, context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp,
        sequence_parallel=sequence_parallel and p.tp > 1,
        bf16=precision == "bf16", fp16=precision == "fp16", params_dtype=_DTYPES[precision],
        pipeline_dtype=_DTYPES[precision] if p.pp > 1 else None,
        # megatron-core refuses variable sequence lengths with its default allgather
        # dispatcher even on dense models; alltoall is the EP dispatcher anyway
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=cpu_init,
        # sequences of a step differ in length; pipeline stages exchange their real shapes
        variable_seq_lengths=True,
        # fused kernels that Transformer Engine provides; the apex-only ones (persistent layer
        # norm, fused weight-gradient accumulation, masked softmax) stay off: apex is not a dependency
        apply_rope_fusion=te, bias_activation_fusion=te, bias_dropout_fusion=te,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    if d.num_experts:
        norm_topk = bool(hf.get("norm_topk_prob", False))
        kw.update(
            num_moe_experts=d.num_experts, moe_ffn_hidden_size=d.moe_ffn, moe_router_topk=int(hf["num_experts_per_tok"]),
            moe_layer_freq=[1 if d.is_moe(i) else 0 for i in range(d.num_layers)],
            # Qwen3-MoE: softmax over all experts, top-k, renormalised iff norm_topk_prob.
            # Megatron: pre_softmax=False is top-k then softmax over the k (= renormalised).
            moe_router_score_function="softmax", moe_router_pre_softmax=not norm_topk,
            # post-training keeps the router as trained: no auxiliary balancing loss
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=te, moe_router_dtype="fp32",
        )
    return kw


def model_kwargs(hf: Mapping, p: Parallel, max_seq_len: int) -> Dict[str, Any]:
    """Keyword arguments of GPTModel (MambaModel for Nemotron-H) besides config, spec,
    pre/post_process."""
    d = dims_of(hf)
    if isinstance(d, NemotronHDims):
        return nemotron_h_config.model_kwargs(d, p, max_seq_len)
    return dict(vocab_size=padded_vocab(d.vocab, p.tp), max_sequence_length=max_seq_len, position_embedding_type="rope",
                share_embeddings_and_output_weights=d.tied, parallel_output=True, **_rope(hf))


def optimizer_kwargs(train: Any, precision: str) -> Dict[str, Any]:
    """megatron.core.optimizer.OptimizerConfig arguments from trainer.optimizer: the
    distributed optimizer (optimizer state sharded over data-parallel ranks); with
    trainer.megatron.optimizer_cpu_offload its hybrid CPU/GPU optimizer (memory.py)."""
    o = train.optimizer
    return dict(optimizer="adam", lr=o.lr, min_lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
                adam_beta2=o.betas[1], adam_eps=o.eps, clip_grad=o.grad_clip,
                # trainer.optimizer.name: adamw decouples the decay, adam adds it to the gradient
                decoupled_weight_decay=o.name == "adamw",
                bf16=precision == "bf16", fp16=precision == "fp16", use_distributed_optimizer=True,
                **optimizer_offload_kwargs(train))


def ddp_kwargs() -> Dict[str, Any]:
    # check_for_nan_in_grad off: it raises on the ranks whose own gradients hold a NaN, before the
    # reduction, while the others wait in it; the backend's NonFiniteGuard (models/nonfinite.py)
    # judges after the reduction on every rank and skips the step on all of them together
    return dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True,
                check_for_nan_in_grad=False)


# ----------------------------------------------------------------- megatron objects (lazy)

def transformer_config(kw: Mapping[str, Any]):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(kw)
    from megatron.core.activations import squared_relu

    kw["activation_func"] = {"silu": F.silu, "squared_relu": squared_relu}[kw["activation_func"]]
    kw["params_dtype"] = getattr(torch, kw["params_dtype"])
    if kw.get("pipeline_dtype"):
        kw["pipeline_dtype"] = getattr(torch, kw["pipeline_dtype"])
    return TransformerConfig(**kw)


def optimizer_config(kw: Mapping[str, Any]):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(**kw)


def layer_spec(config, te: bool):
    """The decoder's layer specs: Transformer Engine's on GPUs with TE, the local ones
    otherwise. The block spec follows moe_layer_freq (dense and MoE layers mixed)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if config.num_moe_experts:
        return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    return specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")


def parallel_of(section: Any, world: int) -> Parallel:
    """The role's `parallel` section over `world` ranks -> Parallel (dp derived)."""
    q = section.parallel
    inner = q.tp * q.cp * q.pp
    if world % inner:
        raise MappingError(f"{world} ranks do not divide by tp*cp*pp = {inner}")
    return Parallel(tp=q.tp, cp=q.cp, dp=world // inner, pp=q.pp, ep=q.ep, etp=q.etp)


def check(hf: Mapping, p: Parallel, sequence_parallel: bool, max_seq_len: int, te: bool = True,
          recompute: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """Every reason this checkpoint cannot be built on this mesh, joined (None: it builds);
    `recompute`: the student's recompute arguments (memory.recompute_kwargs), checked against its layers."""
    d = dims_of(hf)
    problems = (nemotron_h_config.layout_problems(hf, d, p, sequence_parallel, max_seq_len, te)
                if isinstance(d, NemotronHDims) else layout_problems(d, p, sequence_parallel, max_seq_len))
    problems += recompute_problems(d, p.pp, recompute or {}, te)
    return "; ".join(problems) if problems else None

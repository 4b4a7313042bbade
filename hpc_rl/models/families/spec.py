"""What a model family is: the data every layer reads about one architecture (issue 46).

Below the families (each `families/<name>/__init__.py` builds one `Family`) and below the
registry that lists them (`families/__init__.py`): this module imports nothing of hpc_rl and
no torch, so the launcher, the config validation and the refit planner can all ask it.

A field is data where the difference between families is data (module names, config keys,
which memory or Megatron rule applies); a hook is a plain function of the family's own
folder where it is code (the Nemotron-H refit's part-wise Mamba splits). Core code never
tests an architecture name: it looks the family up (`families.of_config(config.json)`) and
reads these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

# fused parameter -> its per-expert tensors: (checkpoint suffix, part, parts) = rows
# [part*R/parts, (part+1)*R/parts) of the expert's [R, C] slice
Members = Mapping[str, Tuple[Tuple[str, int, int], ...]]


# The Llama-style decoder's linear modules (HF names inside a layer): the LoRA targets of most
# dense families (peft adapts each; vLLM's LoRA layers stack them as qkv_proj / gate_up_proj)
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
GATED_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TensorParallelPlan:
    """fsdp2's DTensor tensor (and sequence) parallel plan of one decoder layer, by HF module
    names inside the layer (models/parallel/tensor_parallel.py applies it). Column-parallel
    modules keep whole heads / MLP columns, row-parallel ones reduce; `norms` are the
    layer's residual-stream norms; `head_norms` are per-head norms applied to a
    column-parallel output (Qwen3's q_norm / k_norm over head_dim): their input is this
    rank's own heads, so their weight's gradient is summed over the tp ranks."""

    column: Tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                               "mlp.up_proj")
    row: Tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    norms: Tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    head_norms: Tuple[str, ...] = ()
    # HF config keys a tp must divide (each rank keeps whole heads and equal MLP/vocab slices)
    divides: Tuple[str, ...] = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class ExpertLayout:
    """What expert parallel (models/parallel/expert_parallel.py) and the per-expert names
    (expert_names.py) need of an MoE family: the HF MoE block classes whose `experts` module
    is replaced, the experts module's 3-D parameters ([E, out, in]) and which per-expert
    checkpoint tensors each becomes, and the expert MLP's kind: `gated` (act(gate) * up, one
    fused gate_up_proj) or `plain` (act(up), no gate)."""

    blocks: Tuple[str, ...]
    members: Members
    mlp: str  # "gated" | "plain"


@dataclass(frozen=True)
class MegatronTraits:
    """How the megatron backend's HF mapping reads this family (models/megatron/hf_mapping.py):
    `qkv_bias` (Qwen2's q/k/v biases), `qk_norm` (per-head q/k norms), `sparse_step` (MoE layers
    by transformers' decoder_sparse_step / mlp_only_layers rule), `hybrid` (a Mamba/attention/MoE
    layer pattern: the family's own megatron_mapping.py)."""

    qkv_bias: bool = False
    qk_norm: bool = False
    sparse_step: bool = False
    hybrid: bool = False


@dataclass(frozen=True)
class Refusal:
    """A setting the family cannot honour for one checkpoint: the key (relative to the role's
    section where `role_key`), the value, why, and what to set instead."""

    key: str
    value: Any
    problem: str
    fix: str


@dataclass(frozen=True)
class RefitHooks:
    """Where a family's vLLM model differs from the Llama-style layout refit/vllm_layout.py
    writes for everyone: its own parameter names, fused members, part-wise splits. Each hook
    answers None for a tensor that is not the family's own (the common rules apply)."""

    owns: Callable[[str], bool]
    vllm_name: Callable[[str], str]
    fused_member: Callable[[str], Optional[str]]
    # (name, global shape, specs, ranks, hf config or None) -> the boxes each TP rank keeps
    pieces: Callable[..., Optional[list]]
    # (name, shape, specs, tp, hf config or None) -> vLLM's local shape on one rank
    local_shape: Callable[..., Optional[Tuple[int, ...]]]
    # the tensors vLLM keeps in float32 whatever the engine's dtype
    keeps_fp32: Callable[[str], bool] = lambda name: False
    # vLLM parameters its loader widens to float32 (a lower-precision tensor loads, rounded)
    widens: Callable[[str], bool] = lambda vllm_name: False


def no_refusals(config: Mapping, *args, **kwargs) -> List[Refusal]:
    return []


@dataclass(frozen=True)
class Family:
    """One model family: its names, what each backend and vLLM do with it, and its refusals."""

    name: str  # model.architecture: the Hugging Face model_type
    label: str  # the family in prose ("Qwen3-MoE")
    architectures: Tuple[str, ...]  # config.json `architectures` classes
    model_types: Tuple[str, ...] = ()  # further model_type values of the same family
    fsdp2: bool = True  # the fsdp2 backend loads it
    megatron: Optional[MegatronTraits] = None  # None: the megatron backend cannot convert it
    tp_plan: Optional[TensorParallelPlan] = None  # None: fsdp2 tensor/context parallel refused
    context_parallel: bool = True  # fsdp2's context parallel (its own K/V all-gather) runs it
    parallel_refusal: str = ""  # why tp (no plan) or cp (context_parallel false) is refused
    experts: Optional[ExpertLayout] = None  # expert parallel on fsdp2 (an MoE family)
    # memory/shape.py's rule for its layers: "dense", "sparse_step" (MoE by decoder_sparse_step)
    # or "hybrid" (one letter per layer: models/hybrid_pattern.py)
    shape: str = "dense"
    # HF config keys a vLLM engine's tp must divide beyond heads and the MLP
    # ((config, tp, ep) -> {key: value}; the family's own rule, e.g. Nemotron-H's groups)
    engine_split: Callable[[Mapping, int, int], Mapping[str, Any]] = lambda config, tp, ep: {}
    # (config, generators on GPUs, generator precision, checkpoint path, tp=, ep=) -> what vLLM
    # cannot serve of it there (tp / ep: the generator's engine sizes)
    engine_refusals: Callable[..., List[Refusal]] = no_refusals
    refit: Optional[RefitHooks] = None
    # the HF config's mixture-of-experts layers exist (a dense variant of an MoE-capable family has none)
    is_moe: Callable[[Mapping], bool] = lambda config: False
    # (config) -> the factor the HF forward multiplies the head's logits by after lm_head (Granite
    # divides them by logits_scaling): chunked_logprobs applies it, as it runs the head itself
    logit_scale: Callable[[Mapping], float] = lambda config: 1.0
    tiny: Tuple[str, ...] = field(default_factory=tuple)  # tiny asset reference prefixes of this family
    # a tiny random model of the family (a spec dataclass with `build(vocab, tokenizer)`, its
    # tiny.py): what tests/test_families.py and bench/logprob_agreement.py --family build; head
    # dim >= 32 (vLLM's CPU attention has no kernel below), sizes that a tp of 2 divides
    test_model: Any = None
    # trainer.lora's default target modules (peft's name suffixes; trainer.lora.target_modules
    # unset); empty: none by default (the user names them)
    lora_targets: Tuple[str, ...] = ()

    @property
    def all_model_types(self) -> Tuple[str, ...]:
        return (self.name,) + tuple(self.model_types)


def divisibility(config: Mapping, keys: Sequence[str], tp: int) -> List[str]:
    """`key=value is not divisible by tp=N` for each key of `config` that tp does not divide
    (num_key_value_heads falls back to the attention heads, as HF configs do)."""
    out = []
    for k in keys:
        v = config.get(k)
        if k == "num_key_value_heads" and v is None:
            v = config.get("num_attention_heads")
        if v is None or v % tp:
            out.append(f"{k}={v} is not divisible by tp={tp}")
    return out

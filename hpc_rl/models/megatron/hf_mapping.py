"""Hugging Face <-> Megatron-core parameter names and tensor layouts, for whole (unsharded)
state dicts of Llama, Qwen2, Qwen3 and Qwen3-MoE. Pure torch: nothing here imports megatron.

What differs between the two sides, per decoder layer:
  - q/k/v: Megatron keeps one `linear_qkv` whose rows are grouped by key/value head (query
    group): for each group, its query heads, then its key head, then its value head. A
    tensor-parallel rank then holds whole groups, so its rows are one contiguous block.
  - gate/up: one `linear_fc1` with the gate rows first, then the up rows.
  - norms: with Transformer Engine layer specs the pre-attention norm is fused into
    `linear_qkv` (`layer_norm_weight`) and, for dense MLPs, the pre-MLP norm into
    `linear_fc1`; the local (non-TE) specs keep `input_layernorm` / `pre_mlp_layernorm`.
  - experts: `local_experts.<e>.linear_fc1` (sequential MLPs) or, with grouped GEMM
    (Transformer Engine's GroupedLinear), `experts.linear_fc1.weight<e>`.
  - the vocabulary: Megatron pads it (rows of zeros) to a multiple of
    `make_vocab_size_divisible_by * tp`; the padding is dropped on the way back.

Conversions are exact copies and concatenations, so HF -> Megatron -> HF is bitwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

import torch

from hpc_rl.models import families

# Hugging Face model_type -> the causal-LM classes this module maps: the families whose
# megatron traits are Llama-style (the hybrid one maps in models/families/nemotron_h/megatron_mapping.py)
ARCHITECTURES = {f.name: f.architectures[0] for f in families.FAMILIES if f.megatron and not f.megatron.hybrid}


class MappingError(ValueError):
    """A checkpoint or state dict this mapping cannot convert (names, shapes, architecture)."""


@dataclass(frozen=True)
class ModelDims:
    """The shapes the conversion needs, read from a Hugging Face config."""

    arch: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3, Qwen3-MoE
    num_experts: int = 0
    moe_ffn: int = 0
    moe_layers: Tuple[int, ...] = field(default_factory=tuple)  # layer indices with a routed MoE MLP

    @classmethod
    def from_hf_config(cls, cfg: Mapping) -> "ModelDims":
        fam = families.of_config(cfg)
        if fam is None or fam.name not in ARCHITECTURES:
            raise MappingError(f"model_type {cfg.get('model_type')!r}: the Megatron mapping covers {sorted(ARCHITECTURES)}")
        arch, traits = fam.name, fam.megatron
        heads = cfg["num_attention_heads"]
        n = cfg["num_hidden_layers"]
        # transformers 5 writes num_local_experts, 4.x num_experts
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if traits.sparse_step else 0
        moe_layers: Tuple[int, ...] = ()
        if experts:
            # transformers' Qwen3-MoE rule: a layer is sparse unless listed in mlp_only_layers,
            # and only every decoder_sparse_step-th layer is
            dense = set(cfg.get("mlp_only_layers") or [])
            step = cfg.get("decoder_sparse_step") or 1
            moe_layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
        return cls(arch=arch, num_layers=n, hidden=cfg["hidden_size"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   ffn=cfg["intermediate_size"], vocab=cfg["vocab_size"], tied=bool(cfg.get("tie_word_embeddings", False)),
                   qkv_bias=traits.qkv_bias or bool(cfg.get("attention_bias", False)), qk_norm=traits.qk_norm,
                   num_experts=experts, moe_ffn=int(cfg.get("moe_intermediate_size") or 0), moe_layers=moe_layers)

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers


@dataclass(frozen=True)
class Style:
    """Which Megatron layer spec the names follow."""

    te: bool = True  # Transformer Engine spec: norms fused into linear_qkv / dense linear_fc1
    grouped_experts: bool = True  # TE grouped GEMM: experts.linear_fc1.weight<e>
    padded_vocab: Optional[int] = None  # Megatron's padded vocabulary rows; None: no padding


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: a multiple of divisible_by * tp (its default rule)."""
    m = divisible_by * tp
    return -(-vocab // m) * m


# ------------------------------------------------------------------------ tensor reshapes

def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q; k; v] rows (HF) -> Megatron's per-query-group order. Works on weights and biases
    and on a tensor-parallel rank's slice (pass its local number of groups)."""
    per = q.shape[0] // groups
    kd = k.shape[0] // groups
    rest = q.shape[1:]
    parts = [q.reshape(groups, per, *rest), k.reshape(groups, kd, *rest), v.reshape(groups, kd, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, groups: int, q_rows_per_group: int, kv_rows_per_group: int):
    """Inverse of interleave_qkv: (q, k, v), each contiguous."""
    rest = qkv.shape[1:]
    g = qkv.reshape(groups, q_rows_per_group + 2 * kv_rows_per_group, *rest)
    q, k, v = torch.split(g, [q_rows_per_group, kv_rows_per_group, kv_rows_per_group], dim=1)
    return q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()


def _pad_rows(t: torch.Tensor, rows: Optional[int]) -> torch.Tensor:
    if rows is None or rows == t.shape[0]:
        return t
    if rows < t.shape[0]:
        raise MappingError(f"padded vocabulary {rows} is smaller than the checkpoint's {t.shape[0]}")
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])


def taker(src: Dict[str, torch.Tensor], where: str):
    """`take(name)`: src.pop(name), or MappingError naming the tensor missing from `where`.
    What is left in `src` afterwards has no counterpart (the converters say so)."""
    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise MappingError(f"{name}: missing from {where}")
        return src.pop(name)
    return take


def vocab_rows(tp_rank: int, local: torch.Tensor, vocab: int) -> Optional[Tuple[int, torch.Tensor]]:
    """A tensor-parallel rank's block of the padded vocabulary clipped to the real rows:
    (first row, rows), or None for a rank holding only padding (it sends nothing)."""
    a = tp_rank * local.shape[0]
    b = min(a + local.shape[0], vocab)
    return (a, local[: b - a]) if b > a else None


# ------------------------------------------------------------------------------- names

def _layer_names(d: ModelDims, s: Style, i: int) -> Dict[str, str]:
    """HF suffix (after model.layers.<i>.) -> Megatron suffix (after decoder.layers.<i>.),
    for the tensors that are renamed one to one."""
    moe = d.is_moe(i)
    out = {"self_attn.o_proj.weight": "self_attention.linear_proj.weight",
           "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight" if s.te else "input_layernorm.weight",
           "post_attention_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight" if s.te and not moe
                                               else "pre_mlp_layernorm.weight")}
    if d.qk_norm:
        out["self_attn.q_norm.weight"] = "self_attention.q_layernorm.weight"
        out["self_attn.k_norm.weight"] = "self_attention.k_layernorm.weight"
    if moe:
        out["mlp.gate.weight"] = "mlp.router.weight"
    else:
        out["mlp.down_proj.weight"] = "mlp.linear_fc2.weight"
    return out


def expert_name(e: int, fc: str, s: Style) -> str:
    """Megatron suffix (after decoder.layers.<i>.) of expert e's linear_fc1 / linear_fc2."""
    return f"mlp.experts.{fc}.weight{e}" if s.grouped_experts else f"mlp.experts.local_experts.{e}.{fc}.weight"


def _qkv_parts(d: ModelDims):
    return d.heads // d.kv_heads * d.head_dim, d.head_dim


# --------------------------------------------------------------------------- conversion

def split_fused_experts(hf: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers 5 keeps a MoE layer's experts fused in memory (`mlp.experts.gate_up_proj`
    [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); checkpoints (and vLLM) name them per
    expert. Returns the per-expert names; other tensors pass through."""
    out: Dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{base}{e}.up_proj.weight"] = up[e].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def hf_to_megatron(hf: Mapping[str, torch.Tensor], d: ModelDims, s: Style = Style()) -> Dict[str, torch.Tensor]:
    """A whole HF state dict (per-expert or fused expert names) -> a whole Megatron one.
    Raises MappingError naming every HF tensor left over or missing."""
    src = dict(split_fused_experts(hf))
    out: Dict[str, torch.Tensor] = {}
    take = taker(src, f"the checkpoint ({d.arch}, {d.num_layers} layers)")

    out["embedding.word_embeddings.weight"] = _pad_rows(take("model.embed_tokens.weight"), s.padded_vocab)
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if not d.tied:
        out["output_layer.weight"] = _pad_rows(take("lm_head.weight"), s.padded_vocab)
    else:
        src.pop("lm_head.weight", None)  # a tied checkpoint may still list it (the same tensor)
    for i in range(d.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for h, m in _layer_names(d, s, i).items():
            out[mp + m] = take(hp + h)
        a = hp + "self_attn."
        out[mp + "self_attention.linear_qkv.weight"] = interleave_qkv(
            take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight"), d.kv_heads)
        if d.qkv_bias:
            out[mp + "self_attention.linear_qkv.bias"] = interleave_qkv(
                take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias"), d.kv_heads)
        if d.is_moe(i):
            for e in range(d.num_experts):
                x = f"{hp}mlp.experts.{e}."
                out[mp + expert_name(e, "linear_fc1", s)] = torch.cat([take(x + "gate_proj.weight"), take(x + "up_proj.weight")])
                out[mp + expert_name(e, "linear_fc2", s)] = take(x + "down_proj.weight")
        else:
            out[mp + "mlp.linear_fc1.weight"] = torch.cat([take(hp + "mlp.gate_proj.weight"), take(hp + "mlp.up_proj.weight")])
    if src:
        raise MappingError(f"{len(src)} checkpoint tensors have no Megatron counterpart, e.g. {sorted(src)[:4]}")
    return out


def megatron_to_hf(mc: Mapping[str, torch.Tensor], d: ModelDims, s: Style = Style()) -> Dict[str, torch.Tensor]:
    """A whole Megatron state dict -> HF checkpoint names (per-expert), vocabulary padding
    dropped; `_extra_state` entries (Transformer Engine's fp8 metadata) are skipped."""
    src = {k: v for k, v in mc.items() if not k.endswith("_extra_state")}
    out: Dict[str, torch.Tensor] = {}
    take = taker(src, "the Megatron state dict")

    out["model.embed_tokens.weight"] = take("embedding.word_embeddings.weight")[: d.vocab]
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if not d.tied:
        out["lm_head.weight"] = take("output_layer.weight")[: d.vocab]
    else:
        src.pop("output_layer.weight", None)  # the last pipeline stage's copy of the embedding
    qr, kr = _qkv_parts(d)
    for i in range(d.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for h, m in _layer_names(d, s, i).items():
            out[hp + h] = take(mp + m)
        a = hp + "self_attn."
        for kind in ("weight", "bias") if d.qkv_bias else ("weight",):
            q, k, v = split_qkv(take(f"{mp}self_attention.linear_qkv.{kind}"), d.kv_heads, qr, kr)
            out[f"{a}q_proj.{kind}"], out[f"{a}k_proj.{kind}"], out[f"{a}v_proj.{kind}"] = q, k, v
        if d.is_moe(i):
            for e in range(d.num_experts):
                x = f"{hp}mlp.experts.{e}."
                gate, up = take(mp + expert_name(e, "linear_fc1", s)).chunk(2)
                out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = gate.contiguous(), up.contiguous()
                out[x + "down_proj.weight"] = take(mp + expert_name(e, "linear_fc2", s))
        else:
            gate, up = take(mp + "mlp.linear_fc1.weight").chunk(2)
            out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
    if src:
        raise MappingError(f"{len(src)} Megatron tensors have no HF counterpart, e.g. {sorted(src)[:4]}")
    return out


_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")


def layer_of(name: str) -> Optional[int]:
    """The decoder layer index in a Megatron name (None: embedding, final norm, output)."""
    m = _LAYER.match(name)
    return int(m.group(2)) if m else None

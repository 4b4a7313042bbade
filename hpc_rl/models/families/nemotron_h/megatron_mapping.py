"""Hugging Face <-> Megatron-core names and tensors for Nemotron-H (issue #25): the hybrid of
Mamba-2 mixers (M), attention (*), non-gated relu2 MLPs (-) and latent MoE layers (E) that
megatron-core 0.16.1 builds as `MambaModel` with `hybrid_override_pattern`. Pure torch.

HF names each block `backbone.layers.<i>.{norm, mixer.*}`; megatron-core's Transformer Engine
stack spec (`models/mamba/mamba_layer_specs.py: mamba_stack_spec`) fuses each block's norm into
its first projection, except an MoE layer's (`pre_mlp_layernorm`):

  M  norm.weight                  -> mixer.in_proj.layer_norm_weight
     mixer.in_proj.weight         -> mixer.in_proj.weight   ([z, x, B, C, dt] rows, as in HF)
     mixer.{conv1d.weight, conv1d.bias, A_log, D, dt_bias, norm.weight, out_proj.weight}: same names
  *  norm.weight                  -> self_attention.linear_qkv.layer_norm_weight
     mixer.{q,k,v}_proj.weight    -> self_attention.linear_qkv.weight (rows per query group)
     mixer.o_proj.weight          -> self_attention.linear_proj.weight
  -  norm.weight                  -> mlp.linear_fc1.layer_norm_weight
     mixer.up_proj / down_proj    -> mlp.linear_fc1 / linear_fc2 (no gate: relu2)
  E  norm.weight                  -> pre_mlp_layernorm.weight
     mixer.gate.weight            -> mlp.router.weight
     mixer.gate.e_score_correction_bias -> mlp.router.expert_bias (fp32 in both)
     mixer.experts.<e>.up_proj / down_proj -> mlp.experts.linear_fc1.weight<e> / linear_fc2.weight<e>
     mixer.shared_experts.up_proj / down_proj -> mlp.shared_experts.linear_fc1 / linear_fc2
     mixer.fc1_latent_proj / fc2_latent_proj -> mlp.fc1_latent_proj / fc2_latent_proj

plus `backbone.embeddings` -> `embedding.word_embeddings`, `backbone.norm_f` ->
`decoder.final_norm` and `lm_head` -> `output_layer` (the vocabulary padded as for GPT).
In-memory transformers models say `model.` for `backbone.`; both are read. MTP layers
(`mtp.*`) are not part of the trained model: the HF export carries them over unchanged
(hpc_rl/ckpt/carry.py). Conversions are copies and concatenations: HF -> Megatron -> HF is
bitwise, dtypes included (A_log and the router bias stay fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Tuple

import torch

from hpc_rl.models.hybrid_pattern import BLOCK_LETTERS, read_pattern  # noqa: F401 (BLOCK_LETTERS importable here)
from hpc_rl.models.megatron.hf_mapping import MappingError, ModelDims, Style, _pad_rows, interleave_qkv, split_qkv, taker

# transformers 5 writes `layers_block_type`, NVIDIA's checkpoints `hybrid_override_pattern`
MAMBA_PARTS = ("conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight", "out_proj.weight")


def pattern_of(cfg: Mapping) -> str:
    """The layer pattern, one letter per layer (M, *, -, E), from either config key."""
    pattern, fault = read_pattern(cfg)
    if fault:
        raise MappingError(f"Nemotron-H {fault[1]} (the Megatron mapping)")
    return pattern


@dataclass(frozen=True)
class NemotronHDims(ModelDims):
    """ModelDims plus what a hybrid layer stack needs. `ffn` is the dense MLP layers' width,
    `moe_ffn` a routed expert's, `shared_ffn` the shared expert's; `latent` the latent MoE's
    width (0: none)."""

    pattern: str = ""
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    groups: int = 0
    state: int = 0
    conv_kernel: int = 4
    shared_ffn: int = 0
    latent: int = 0

    @classmethod
    def from_hf_config(cls, cfg: Mapping) -> "NemotronHDims":
        if cfg.get("model_type") != "nemotron_h":
            raise MappingError(f"model_type {cfg.get('model_type')!r} is not nemotron_h")
        pattern = pattern_of(cfg)
        heads = cfg["num_attention_heads"]
        moe = tuple(i for i, c in enumerate(pattern) if c == "E")
        return cls(arch="nemotron_h", num_layers=len(pattern), hidden=cfg["hidden_size"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn=cfg["intermediate_size"],
                   vocab=cfg["vocab_size"], tied=bool(cfg.get("tie_word_embeddings", False)),
                   qkv_bias=bool(cfg.get("attention_bias", False)),
                   num_experts=int(cfg.get("n_routed_experts") or 0) if moe else 0,
                   moe_ffn=int(cfg.get("moe_intermediate_size") or 0) if moe else 0, moe_layers=moe,
                   pattern=pattern, mamba_heads=cfg["mamba_num_heads"], mamba_head_dim=cfg["mamba_head_dim"],
                   groups=cfg["n_groups"], state=cfg["ssm_state_size"], conv_kernel=cfg.get("conv_kernel", 4),
                   shared_ffn=int(cfg.get("moe_shared_expert_intermediate_size") or 0)
                   if moe and cfg.get("n_shared_experts") else 0,
                   latent=int(cfg.get("moe_latent_size") or 0) if moe else 0)

    @property
    def mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    def in_proj_parts(self) -> Tuple[int, int, int, int, int]:
        """Rows of in_proj's z, x, B, C, dt."""
        gn = self.groups * self.state
        return self.mamba_inner, self.mamba_inner, gn, gn, self.mamba_heads

    def conv_parts(self) -> Tuple[int, int, int]:
        """Channels of conv1d's x, B, C."""
        gn = self.groups * self.state
        return self.mamba_inner, gn, gn


def _renames(d: NemotronHDims, i: int) -> Dict[str, str]:
    """HF suffix (after <body>.layers.<i>.) -> Megatron suffix (after decoder.layers.<i>.), for
    the tensors renamed one to one in layer i."""
    kind = d.pattern[i]
    if kind == "M":
        out = {"norm.weight": "mixer.in_proj.layer_norm_weight", "mixer.in_proj.weight": "mixer.in_proj.weight"}
        out.update({f"mixer.{p}": f"mixer.{p}" for p in MAMBA_PARTS})
        return out
    if kind == "*":
        return {"norm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "mixer.o_proj.weight": "self_attention.linear_proj.weight"}
    if kind == "-":
        return {"norm.weight": "mlp.linear_fc1.layer_norm_weight", "mixer.up_proj.weight": "mlp.linear_fc1.weight",
                "mixer.down_proj.weight": "mlp.linear_fc2.weight"}
    out = {"norm.weight": "pre_mlp_layernorm.weight", "mixer.gate.weight": "mlp.router.weight",
           "mixer.gate.e_score_correction_bias": "mlp.router.expert_bias"}
    if d.shared_ffn:
        out.update({"mixer.shared_experts.up_proj.weight": "mlp.shared_experts.linear_fc1.weight",
                    "mixer.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight"})
    if d.latent:
        out.update({"mixer.fc1_latent_proj.weight": "mlp.fc1_latent_proj.weight",
                    "mixer.fc2_latent_proj.weight": "mlp.fc2_latent_proj.weight"})
    for e in range(d.num_experts):
        out[f"mixer.experts.{e}.up_proj.weight"] = f"mlp.experts.linear_fc1.weight{e}"
        out[f"mixer.experts.{e}.down_proj.weight"] = f"mlp.experts.linear_fc2.weight{e}"
    return out


def layer_renames(d: NemotronHDims, i: int) -> Dict[str, str]:
    """Megatron suffix -> HF suffix of layer i's one-to-one tensors (the refit's source side)."""
    return {m: h for h, m in _renames(d, i).items()}


def split_fused_experts_nh(hf: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers 5 holds a Nemotron-H MoE layer's experts fused in memory
    (`mixer.experts.up_proj` [E, I, H], `mixer.experts.down_proj` [E, H, I]); checkpoints name
    them per expert. Returns the per-expert names; other tensors pass through."""
    out: Dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        for kind in ("up_proj", "down_proj"):
            if name.endswith(f".mixer.experts.{kind}") and t.dim() == 3:
                base = name[: -len(kind)]
                for e in range(t.shape[0]):
                    out[f"{base}{e}.{kind}.weight"] = t[e].contiguous()
                break
        else:
            out[name] = t
    return out


def _body(hf: Mapping[str, torch.Tensor]) -> str:
    """`backbone` (checkpoints) or `model` (transformers' module in memory)."""
    return "model" if any(n.startswith("model.") for n in hf) and not any(n.startswith("backbone.") for n in hf) \
        else "backbone"


def hf_to_megatron(hf: Mapping[str, torch.Tensor], d: NemotronHDims, s: Style = Style()) -> Dict[str, torch.Tensor]:
    """A whole HF Nemotron-H state dict -> a whole Megatron MambaModel one. MTP tensors are
    skipped (carried by the export); anything else left over or missing raises MappingError."""
    src = {k: v for k, v in split_fused_experts_nh(hf).items() if not k.startswith("mtp.")}
    body = _body(src)
    out: Dict[str, torch.Tensor] = {}
    take = taker(src, f"the checkpoint (nemotron_h, pattern {d.pattern})")

    out["embedding.word_embeddings.weight"] = _pad_rows(take(f"{body}.embeddings.weight"), s.padded_vocab)
    out["decoder.final_norm.weight"] = take(f"{body}.norm_f.weight")
    if not d.tied:
        out["output_layer.weight"] = _pad_rows(take("lm_head.weight"), s.padded_vocab)
    else:
        src.pop("lm_head.weight", None)
    for i, kind in enumerate(d.pattern):
        hp, mp = f"{body}.layers.{i}.", f"decoder.layers.{i}."
        for h, m in _renames(d, i).items():
            out[mp + m] = take(hp + h)
        if kind == "*":
            a = hp + "mixer."
            out[mp + "self_attention.linear_qkv.weight"] = interleave_qkv(
                take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight"), d.kv_heads)
            if d.qkv_bias:
                out[mp + "self_attention.linear_qkv.bias"] = interleave_qkv(
                    take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias"), d.kv_heads)
    if src:
        raise MappingError(f"{len(src)} checkpoint tensors have no Megatron counterpart, e.g. {sorted(src)[:4]}")
    return out


def megatron_to_hf(mc: Mapping[str, torch.Tensor], d: NemotronHDims, s: Style = Style(),
                   body: str = "backbone") -> Dict[str, torch.Tensor]:
    """A whole Megatron MambaModel state dict -> HF checkpoint names (`body`.layers..., per
    expert), vocabulary padding dropped; `_extra_state` entries are skipped."""
    src = {k: v for k, v in mc.items() if not k.endswith("_extra_state")}
    out: Dict[str, torch.Tensor] = {}
    take = taker(src, "the Megatron state dict")

    out[f"{body}.embeddings.weight"] = take("embedding.word_embeddings.weight")[: d.vocab]
    out[f"{body}.norm_f.weight"] = take("decoder.final_norm.weight")
    if not d.tied:
        out["lm_head.weight"] = take("output_layer.weight")[: d.vocab]
    else:
        src.pop("output_layer.weight", None)
    q_rows = d.heads // d.kv_heads * d.head_dim
    for i, kind in enumerate(d.pattern):
        hp, mp = f"{body}.layers.{i}.", f"decoder.layers.{i}."
        for h, m in _renames(d, i).items():
            out[hp + h] = take(mp + m)
        if kind == "*":
            for part in ("weight", "bias") if d.qkv_bias else ("weight",):
                q, k, v = split_qkv(take(f"{mp}self_attention.linear_qkv.{part}"), d.kv_heads, q_rows, d.head_dim)
                a = hp + "mixer."
                out[f"{a}q_proj.{part}"], out[f"{a}k_proj.{part}"], out[f"{a}v_proj.{part}"] = q, k, v
    if src:
        raise MappingError(f"{len(src)} Megatron tensors have no HF counterpart, e.g. {sorted(src)[:4]}")
    return out


def dims_of(cfg: Mapping) -> ModelDims:
    """The dims of any HF config the Megatron backend maps: Nemotron-H's or a GPT family's."""
    return NemotronHDims.from_hf_config(cfg) if cfg.get("model_type") == "nemotron_h" else ModelDims.from_hf_config(cfg)

"""Nemotron-H in a vLLM engine of tensor parallel tp, in Hugging Face names.

What differs from a Llama (vllm/model_executor/models/nemotron_h.py and
layers/mamba/mamba_mixer2.py, vLLM 0.32):

- names: HF checkpoints say `backbone.`, transformers' model in memory `model.`; vLLM
  says `model.`, `embed_tokens` for `embeddings`, and holds `A` where HF has `A_log`
  (its loader stores `-exp(A_log)` in float32). q/k/v stack into `qkv_proj` as for Llama;
  the MLP's `up_proj` is a plain column-parallel linear (relu2, no gate: not fused).
- the Mamba-2 mixer's `in_proj` is one tensor of five parts [z, x, B, C, dt] (rows I, I,
  G*N, G*N, H) and `conv1d` (weight [I + 2GN, 1, K], bias) of three [x, B, C]. vLLM splits
  each PART over the TP ranks, so rank r holds [z_r, x_r, B_r, C_r, dt_r]: five boxes of
  the HF tensor, never one contiguous chunk (a plain chunk would hand rank 0 all of z and
  half of x). A_log, D and dt_bias split by heads, the gated norm's weight [I] by rows
  (whole groups per rank when tp divides n_groups), out_proj by columns.

The B/C groups: vLLM splits them over the TP ranks when tp divides n_groups; with a single
group (n_groups == 1, as many Mamba-2 checkpoints have) it replicates the group on every
rank (mamba_mixer2.py: `mamba_v2_sharded_weight_loader` with `duplicate_groups`, and one
extra group per further rank in the engine's parameter), so rank r holds [z_r, x_r, B, C,
dt_r] of in_proj and [x_r, B, C] of conv1d. Which of the two a checkpoint needs is not in
the tensors' shapes (G*N says nothing of G): the HF config tells (`hf_config`); without it
the groups are split, and `vllm_layout.check_against_model` would catch a single group
against the live engine's shapes. Other group counts that tp does not divide vLLM asserts
against (rl/inputs.py refuses them before launch: the family's `_engine_split`).
"""

from __future__ import annotations

import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hpc_rl.refit.layout import LayoutError, Piece

Specs = Mapping[str, Tuple[Sequence[int], str]]

_MIXER = re.compile(r"^(?P<layer>.*\.mixer)\.(?P<part>in_proj\.weight|conv1d\.weight|conv1d\.bias|A_log|D|dt_bias|"
                    r"norm\.weight|out_proj\.weight)$")
_QKV = re.compile(r"\.mixer\.(q_proj|k_proj|v_proj)\.")


def owns(name: str) -> bool:
    """A name only Nemotron-H uses (its layers call every block `mixer`, its embedding
    `embeddings`, its checkpoints' body `backbone`)."""
    return ".mixer." in name or name.startswith("backbone.") or ".embeddings." in name or name.endswith("norm_f.weight")


def is_nemotron_h(specs: Specs) -> bool:
    return any(n.endswith(".mixer.A_log") for n in specs)


def vllm_name(name: str) -> str:
    """The vLLM parameter an HF tensor loads into (vLLM's hf_to_vllm_mapper)."""
    if name.startswith("backbone."):
        name = "model." + name[len("backbone."):]
    name = name.replace(".embeddings.", ".embed_tokens.").replace(".mixer.A_log", ".mixer.A")
    m = _QKV.search(name)
    return name.replace(f".{m.group(1)}.", ".qkv_proj.") if m else name


def fused_member(name: str) -> Optional[str]:
    """q_proj / k_proj / v_proj for the attention's stacked members, else None (the MLP's
    up_proj is not fused in Nemotron-H)."""
    m = _QKV.search(name)
    return m.group(1) if m else None


def mamba_dims(specs: Specs, layer: str) -> Dict[str, int]:
    """Sizes of one mixer from its tensors' shapes: heads H (A_log), inner I and the B/C
    width G*N (in_proj rows 2I + 2GN + H, conv1d rows I + 2GN)."""
    heads = specs[f"{layer}.A_log"][0][0]
    conv = specs[f"{layer}.conv1d.weight"][0][0]
    inner = specs[f"{layer}.in_proj.weight"][0][0] - conv - heads
    return {"heads": heads, "inner": inner, "gn": (conv - inner) // 2}


def widens(vllm_param: str) -> bool:
    """vLLM keeps A in float32 whatever the engine's dtype (its loader widens A_log before -exp)."""
    return vllm_param.endswith(".mixer.A")


def replicates_groups(hf_config: Optional[Mapping], tp: int) -> bool:
    """vLLM keeps the single B/C group whole on every rank (n_groups == 1 and tp > 1)."""
    return tp > 1 and hf_config is not None and hf_config.get("n_groups") == 1


def _parts(part: str, d: Dict[str, int]) -> Optional[List[int]]:
    if part == "in_proj.weight":
        return [d["inner"], d["inner"], d["gn"], d["gn"], d["heads"]]
    if part.startswith("conv1d."):
        return [d["inner"], d["gn"], d["gn"]]
    return None


def _whole_parts(part: str, replicate: bool) -> Tuple[int, ...]:
    """Indices of the parts every rank keeps whole: B and C when the single group is replicated."""
    if not replicate:
        return ()
    return (2, 3) if part == "in_proj.weight" else (1, 2) if part.startswith("conv1d.") else ()


def mixer_pieces(name: str, shape: Sequence[int], specs: Specs, ranks: Sequence[int],
                 hf_config: Optional[Mapping] = None) -> Optional[List[Piece]]:
    """The boxes of a Mamba mixer tensor each TP rank of vLLM keeps (None: not a mixer
    tensor of Nemotron-H's own; the caller lays it out as for Llama). `hf_config`: the
    checkpoint's config.json (its n_groups decides whether B/C are split or replicated)."""
    m = _MIXER.match(name)
    if not m:
        return None
    tp, part = len(ranks), m.group("part")
    dims = mamba_dims(specs, m.group("layer"))
    full = tuple(shape)
    split_dim = 1 if part == "out_proj.weight" else 0
    sizes = _parts(part, dims) or [full[split_dim]]  # the norm, A_log, D, dt_bias, out_proj: one part
    whole = _whole_parts(part, replicates_groups(hf_config, tp))
    bad = [s for i, s in enumerate(sizes) if s % tp and i not in whole]
    if bad:
        raise LayoutError(f"{name}: parts of {sizes} rows do not split over tensor parallel {tp} (vLLM splits each "
                          f"of in_proj's z/x/B/C/dt, conv1d's x/B/C and the heads evenly)")
    out: List[Piece] = []
    for r, rank in enumerate(ranks):
        offset, rows = 0, []
        for i, size in enumerate(sizes):
            a, b = (offset, offset + size) if i in whole else (offset + r * (size // tp), offset + (r + 1) * (size // tp))
            # adjacent parts (tp 1; a replicated group beside its neighbours): one box, as the
            # planner expects (PreShardedWeight hands vLLM's loader each part's rows of it)
            if rows and rows[-1][1] == a:
                rows[-1] = (rows[-1][0], b)
            else:
                rows.append((a, b))
            offset += size
        for a, b in rows:
            start, stop = [0] * len(full), list(full)
            start[split_dim], stop[split_dim] = a, b
            out.append(Piece(rank, tuple(start), tuple(stop)))
    return out


def local_shape(name: str, shape: Sequence[int], specs: Specs, tp: int,
                hf_config: Optional[Mapping] = None) -> Optional[Tuple[int, ...]]:
    """The shape of vLLM's parameter for a mixer tensor on one TP rank (None: not one)."""
    m = _MIXER.match(name)
    if not m:
        return None
    local, part = list(shape), m.group("part")
    whole = _whole_parts(part, replicates_groups(hf_config, tp))
    if whole:  # the replicated B and C whole, the other parts split
        sizes = _parts(part, mamba_dims(specs, m.group("layer")))
        local[0] = sum(s if i in whole else s // tp for i, s in enumerate(sizes))
    else:
        local[1 if part == "out_proj.weight" else 0] //= tp
    return tuple(local)

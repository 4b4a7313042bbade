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

vLLM replicates the B/C groups on every rank when n_groups == 1 and tp > 1; this layout
assumes tp divides n_groups (rl/inputs.py refuses the other case before launch, and
`vllm_layout.check_against_model` would catch it against the live engine's shapes).
"""

from __future__ import annotations

import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .layout import LayoutError, Piece

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


def _parts(part: str, d: Dict[str, int]) -> Optional[List[int]]:
    if part == "in_proj.weight":
        return [d["inner"], d["inner"], d["gn"], d["gn"], d["heads"]]
    if part.startswith("conv1d."):
        return [d["inner"], d["gn"], d["gn"]]
    return None


def mixer_pieces(name: str, shape: Sequence[int], specs: Specs, ranks: Sequence[int]) -> Optional[List[Piece]]:
    """The boxes of a Mamba mixer tensor each TP rank of vLLM keeps (None: not a mixer
    tensor of Nemotron-H's own; the caller lays it out as for Llama)."""
    m = _MIXER.match(name)
    if not m:
        return None
    tp, part = len(ranks), m.group("part")
    dims = mamba_dims(specs, m.group("layer"))
    full = tuple(shape)
    split_dim = 1 if part == "out_proj.weight" else 0
    sizes = _parts(part, dims) or [full[split_dim]]  # the norm, A_log, D, dt_bias, out_proj: one part
    bad = [s for s in sizes if s % tp]
    if bad:
        raise LayoutError(f"{name}: parts of {sizes} rows do not split over tensor parallel {tp} (vLLM splits each "
                          f"of in_proj's z/x/B/C/dt, conv1d's x/B/C and the heads evenly)")
    out: List[Piece] = []
    for r, rank in enumerate(ranks):
        offset, rows = 0, []
        for size in sizes:
            per = size // tp
            if rows and rows[-1][1] == offset + r * per:  # adjacent parts (tp 1): one box, as the planner expects
                rows[-1] = (rows[-1][0], offset + (r + 1) * per)
            else:
                rows.append((offset + r * per, offset + (r + 1) * per))
            offset += size
        for a, b in rows:
            start, stop = [0] * len(full), list(full)
            start[split_dim], stop[split_dim] = a, b
            out.append(Piece(rank, tuple(start), tuple(stop)))
    return out


def local_shape(name: str, shape: Sequence[int], specs: Specs, tp: int) -> Optional[Tuple[int, ...]]:
    """The shape of vLLM's parameter for a mixer tensor on one TP rank (None: not one)."""
    m = _MIXER.match(name)
    if not m:
        return None
    local = list(shape)
    local[1 if m.group("part") == "out_proj.weight" else 0] //= tp
    return tuple(local)

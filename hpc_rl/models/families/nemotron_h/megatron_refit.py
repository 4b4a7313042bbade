"""The refit source side of a Megatron-core Nemotron-H trainer (issue #25): a rank's local
MambaModel tensors as boxes of the HF checkpoint tensors (`backbone.` names), for the refit
planner, which moves them into vLLM's Nemotron-H layout (refit_layout.py).

Where a rank's tensor is one box of the HF tensor (heads, rows, columns, whole), it is one
(start, view) pair. A Mamba mixer's in_proj on tensor-parallel rank r holds
[z_r, x_r, B_r, C_r, dt_r] and its conv1d [x_r, B_r, C_r]: five and three boxes of the HF
tensor, handed as a list of (start, view) pairs; vLLM's TP workers hold the same kind of
pieces, so with equal tp every piece travels whole to one worker. The split of each tensor is
shards.py's (`_kind`), so what the trainer holds and what the layout says cannot disagree.
"""

from __future__ import annotations

import re
from typing import Dict, List, Mapping, Tuple, Union

import torch

from hpc_rl.refit.layout import LayoutError

from hpc_rl.models.megatron.hf_mapping import Style, split_qkv, vocab_rows
from .megatron_mapping import NemotronHDims, layer_renames
from hpc_rl.models.megatron.shards import Parallel, _kind, coords_of, stage_layers

Start = Tuple[int, ...]
Boxes = Union[Tuple[Start, torch.Tensor], List[Tuple[Start, torch.Tensor]]]
_LOCAL = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def _boxes(t: torch.Tensor, kind, parts, coord: int, tp: int) -> Boxes:
    """The HF boxes of a rank's local tensor split as `kind` over `tp` ranks, this rank at
    coordinate `coord` of the group that splits it."""
    zeros = (0,) * t.dim()
    if kind is None or tp == 1:
        return zeros, t
    if kind in ("col", "ecol"):
        return (coord * t.shape[0],) + zeros[1:], t
    if kind in ("row", "erow"):
        return (0, coord * t.shape[1]) + zeros[2:], t
    if kind == "parts":
        out: List[Tuple[Start, torch.Tensor]] = []
        whole_at = local_at = 0
        for size in parts:
            n = size // tp
            out.append(((whole_at + coord * n,) + zeros[1:], t[local_at:local_at + n]))
            whole_at, local_at = whole_at + size, local_at + n
        return out
    raise LayoutError(f"split kind {kind!r} has no Nemotron-H refit boxes")


def local_hf_shards(local: Mapping[str, torch.Tensor], d: NemotronHDims, s: Style, p: Parallel, rank: int,
                    body: str = "backbone") -> Dict[str, Boxes]:
    """This rank's MambaModel tensors (local names) as HF-named boxes: name -> (global start,
    tensor), or a list of them for a mixer's in_proj / conv1d. Views, except q/k/v (small
    copies, as for GPT models)."""
    c = coords_of(rank, p)
    first = stage_layers(d.num_layers, p.pp, c.pp).start
    out: Dict[str, Boxes] = {}
    for name, t in local.items():
        if name.endswith("_extra_state"):
            continue
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if name == "output_layer.weight" and d.tied:
                continue
            rows = vocab_rows(c.tp, t, d.vocab)
            if rows:
                out[f"{body}.embeddings.weight" if name.startswith("embedding") else "lm_head.weight"] = ((rows[0], 0), rows[1])
            continue
        if name == "decoder.final_norm.weight":
            out[f"{body}.norm_f.weight"] = ((0,), t)
            continue
        m = _LOCAL.match(name)
        if m is None:
            raise LayoutError(f"{name}: not a Megatron MambaModel parameter this mapping knows")
        layer, suffix = first + int(m.group(1)), m.group(2)
        hp = f"{body}.layers.{layer}."
        kind, parts = _kind(suffix, True, d)
        expert = _EXPERT.match(suffix)
        if expert:  # local expert index -> the model's
            suffix = f"mlp.experts.{expert.group(1)}.weight{c.ep * (d.num_experts // p.ep) + int(expert.group(2))}"
        coord, tp = (c.etp, p.etp) if kind in ("ecol", "erow") else (c.tp, p.tp)
        if suffix.startswith("self_attention.linear_qkv.") and "layer_norm" not in suffix:
            part = suffix.rsplit(".", 1)[1]
            q, k, v = split_qkv(t, d.kv_heads // p.tp, d.heads // d.kv_heads * d.head_dim, d.head_dim)
            for letter, rows in (("q", q), ("k", k), ("v", v)):
                out[f"{hp}mixer.{letter}_proj.{part}"] = ((c.tp * rows.shape[0],) + (0,) * (t.dim() - 1), rows)
            continue
        hf = layer_renames(d, layer).get(suffix)
        if hf is None:
            raise LayoutError(f"{name}: no HF counterpart in layer {layer} ({d.pattern[layer]})")
        out[hp + hf] = _boxes(t, kind, parts, coord, tp)
    return out


def pieces(boxes: Boxes) -> List[Tuple[Start, torch.Tensor]]:
    """A name's boxes as a list, one box or several."""
    return boxes if isinstance(boxes, list) else [boxes]

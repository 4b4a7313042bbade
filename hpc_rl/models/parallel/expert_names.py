"""Fused expert tensors in memory, one tensor per expert in checkpoints and in vLLM's loaders.

transformers 5 keeps an MoE layer's experts as 3-D parameters (expert dimension first);
`save_pretrained` and vLLM's weight loaders use one tensor per expert. The refit speaks the
checkpoint's names, so its specs and every rank's shards are translated here, for every
family of expert_families.py:

    Qwen3-MoE   mlp.experts.gate_up_proj [E, 2I, H] -> mlp.experts.<e>.gate_proj.weight [I, H]
                                                       mlp.experts.<e>.up_proj.weight   [I, H]
                mlp.experts.down_proj    [E, H, I]  -> mlp.experts.<e>.down_proj.weight [H, I]
    Nemotron-H  mixer.experts.up_proj    [E, I, L]  -> mixer.experts.<e>.up_proj.weight   [I, L]
                mixer.experts.down_proj  [E, L, I]  -> mixer.experts.<e>.down_proj.weight [L, I]

(L: the latent MoE size, or the hidden size.) A rank's box of a fused tensor must hold whole
experts (FSDP2's Shard(0) and expert parallel both split the expert dimension only); the
per-expert tensors are views into the live parameter, not copies. Everything else (routers
and their `e_score_correction_bias`, shared experts, latent projections) keeps its name.
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, Sequence, Tuple

import torch

from .expert_families import MEMBERS

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>" + "|".join(map(re.escape, MEMBERS)) + r")$")


def is_fused(name: str) -> bool:
    return _FUSED.match(name) is not None


def _members(name: str, shape: Sequence[int]) -> Iterator[Tuple[str, slice, Tuple[int, ...]]]:
    """(per-expert suffix, rows of the fused tensor's 2nd dim, per-expert shape) for one expert."""
    for suffix, part, parts in MEMBERS[_FUSED.match(name).group("kind")]:
        rows = shape[1] // parts
        yield suffix, slice(part * rows, (part + 1) * rows), (rows, shape[2])


def checkpoint_specs(specs: Dict[str, Tuple[Tuple[int, ...], object]]) -> Dict[str, Tuple[Tuple[int, ...], object]]:
    """name -> (global shape, dtype) with every fused expert tensor as its per-expert tensors."""
    out = {}
    for name, (shape, dtype) in specs.items():
        m = _FUSED.match(name)
        if not m or len(shape) != 3:
            out[name] = (tuple(shape), dtype)
            continue
        for e in range(shape[0]):
            for suffix, _, sub in _members(name, shape):
                out[f"{m.group('prefix')}.{e}.{suffix}"] = (sub, dtype)
    return out


def checkpoint_shards(name: str, global_shape: Sequence[int], start: Sequence[int],
                      local: torch.Tensor) -> Dict[str, Tuple[Tuple[int, ...], torch.Tensor]]:
    """A rank's box of one tensor -> its boxes by checkpoint name (a plain tensor: itself)."""
    m = _FUSED.match(name)
    if not m or len(global_shape) != 3:
        return {name: (tuple(start), local)}
    if any(start[1:]) or tuple(local.shape[1:]) != tuple(global_shape[1:]):
        raise RuntimeError(f"{name}: this rank's box {tuple(start)}+{tuple(local.shape)} splits experts inside; "
                           f"only whole experts per rank are supported")
    out = {}
    for i in range(local.shape[0]):
        for suffix, rows, _ in _members(name, global_shape):
            out[f"{m.group('prefix')}.{start[0] + i}.{suffix}"] = ((0, 0), local[i, rows])
    return out


def to_checkpoint_names(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A whole state dict with fused experts written per expert (what save_pretrained does,
    and what vLLM's loader reads)."""
    out: Dict[str, torch.Tensor] = {}
    for name, t in state.items():
        out.update({n: v for n, (_, v) in checkpoint_shards(name, tuple(t.shape), (0,) * t.dim(), t).items()})
    return out

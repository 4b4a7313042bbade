"""Fused expert tensors in memory, one tensor per expert in checkpoints and in vLLM's loaders.

transformers 5 keeps an MoE layer's experts as two 3-D parameters (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]); `save_pretrained` and vLLM's weight loaders
use per-expert names (`mlp.experts.<e>.gate_proj.weight` [I, H], `up_proj` [I, H],
`down_proj` [H, I]). The refit speaks the checkpoint's names, so its specs and every rank's
shards are translated here. A rank's box of a fused tensor must hold whole experts (FSDP2's
Shard(0) and expert parallel both split the expert dimension only); the per-expert tensors
are views into the live parameter, not copies.
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, Sequence, Tuple

import torch

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def is_fused(name: str) -> bool:
    return _FUSED.match(name) is not None


def _members(name: str, shape: Sequence[int]) -> Iterator[Tuple[str, slice, Tuple[int, ...]]]:
    """(per-expert suffix, rows of the fused tensor's 2nd dim, per-expert shape) for one expert."""
    kind = _FUSED.match(name).group("kind")
    if kind == "down_proj":
        yield "down_proj.weight", slice(0, shape[1]), (shape[1], shape[2])
        return
    half = shape[1] // 2  # HF stores gate then up: gate, up = linear(x, gate_up).chunk(2)
    yield "gate_proj.weight", slice(0, half), (half, shape[2])
    yield "up_proj.weight", slice(half, shape[1]), (half, shape[2])


def checkpoint_specs(specs: Dict[str, Tuple[Tuple[int, ...], object]]) -> Dict[str, Tuple[Tuple[int, ...], object]]:
    """name -> (global shape, dtype) with every fused expert tensor as its per-expert tensors."""
    out = {}
    for name, (shape, dtype) in specs.items():
        m = _FUSED.match(name)
        if not m:
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
    if not m:
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

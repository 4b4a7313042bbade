"""Small Python objects between ranks: prompts, sampled rows, teacher scores, rewards.

The control-plane data of a step is kilobytes to megabytes, so it travels as pickles over
gloo object broadcasts on the world group. Tensors that scale with the model (refit) use
their own groups. Every rank of the group must call `share` in the same order.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch.distributed as dist


def share(obj: Any, src: int, group: Optional[dist.ProcessGroup] = None) -> Any:
    """`obj` from global rank `src` to every rank of `group` (world by default)."""
    buf = [obj]
    dist.broadcast_object_list(buf, src=src, group=group)
    return buf[0]


def gather_all(obj: Any, group: dist.ProcessGroup) -> List[Any]:
    """Every member's `obj`, in group-rank order, on every member."""
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def strided(n: int, part: int, parts: int) -> List[int]:
    """The indices of `range(n)` that member `part` of `parts` handles (round robin)."""
    return list(range(part, n, parts))


def interleave(pieces: Sequence[Sequence[Any]], n: int) -> List[Any]:
    """Inverse of `strided`: pieces[k] holds items k, k+parts, ...; returns them in order."""
    out: List[Any] = [None] * n
    parts = len(pieces)
    for k, piece in enumerate(pieces):
        for j, item in enumerate(piece):
            out[k + j * parts] = item
    return out

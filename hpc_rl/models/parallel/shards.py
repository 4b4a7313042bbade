"""This rank's box of every weight, read from the live parameters (plain tensors, FSDP2's
Shard(0), DTensor tensor parallel, both at once), and the refit source layout gathered
from every rank's boxes: the planner then moves exactly the bytes each rank holds."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hpc_rl.runtime import sealed

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]


def local_box(value: torch.Tensor) -> Tuple[Box, torch.Tensor]:
    """(start, stop) of this rank's piece in the global tensor, and the piece itself."""
    if hasattr(value, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        local = value.to_local()
        if tuple(local.shape) != tuple(shape):
            raise RuntimeError(f"a DTensor's local piece {tuple(local.shape)} is not the expected {tuple(shape)}")
        return (tuple(offset), tuple(o + s for o, s in zip(offset, shape))), local
    return (tuple(0 for _ in value.shape), tuple(value.shape)), value


def local_boxes(state: Dict[str, torch.Tensor]) -> Dict[str, Box]:
    return {name: local_box(v)[0] for name, v in state.items()}


def gather_source_layout(boxes: Dict[str, Box], specs: Dict[str, Tuple[Tuple[int, ...], str]],
                         group: Optional[dist.ProcessGroup]):
    """The refit source Layout: every rank of `group` (refit ranks 0..n-1 in group order)
    and the boxes it holds (by checkpoint name: per-expert tensors on the ep ranks that hold
    them); a box held by several ranks (tp replicas of a norm, dp or expert-dp replicas)
    is a replica the planner may read from any of them. A collective of the group."""
    from hpc_rl.refit.layout import Layout, Piece

    n = dist.get_world_size(group) if group is not None else 1
    every: List[Dict[str, Box]] = [boxes] if n == 1 else sealed.all_gather(boxes, group)  # MAC checked before loads
    lay = Layout()
    for r in range(n):
        unknown = sorted(set(every[r]) - set(specs))
        if unknown:
            raise ValueError(f"{unknown[0]}: rank {r} holds it, the refit specs do not name it")
    for name, (shape, dtype) in specs.items():
        # a rank that holds no piece of a tensor (another ep rank's experts) adds none
        lay.add(name, shape, dtype, [Piece(r, every[r][name][0], every[r][name][1]) for r in range(n) if name in every[r]])
    return lay

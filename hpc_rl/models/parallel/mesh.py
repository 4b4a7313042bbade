"""The DeviceMesh of one role's ranks, from its `parallel` section.

Rank order (the placement rule, plan/placement.py): within a role, tensor parallel is
innermost, then context parallel, then data parallel, so a TP group is a run of
consecutive ranks (one node, one NVLink domain) and data parallel spans nodes. The
expert mesh tiles the same ranks with expert tensor parallel innermost, then expert
parallel, so an EP group is a run of `ep * etp` consecutive ranks too (what
runtime/comm_check.py checks on a real allocation).

The mesh is built over the role's own process group: only its members create the
sub-groups (`use_local_synchronization`), so the other roles of the job never wait on a
trainer's or a teacher group's mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

DENSE_DIMS = ("dp", "cp", "tp")  # outermost first: the row-major order of role ranks


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1  # borrows its ranks from dp x cp x tp (as torchtitan does); not a factor of the world
    etp: int = 1

    def __post_init__(self):
        for name in ("dp", "tp", "cp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.world % (self.ep * self.etp):
            raise ValueError(f"ep x etp = {self.ep}x{self.etp} must divide the role's {self.world} ranks")

    @classmethod
    def for_world(cls, world: int, tp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1,
                  dp: Optional[int] = None) -> "ParallelDims":
        """dp derived from the role's ranks when not given (config: parallel.dp unset)."""
        if world % (tp * cp):
            raise ValueError(f"tp x cp = {tp}x{cp} does not divide the role's {world} ranks")
        derived = world // (tp * cp)
        if dp is not None and dp != derived:
            raise ValueError(f"parallel.dp={dp} but tp x cp x dp must equal the role's {world} ranks (dp={derived})")
        return cls(dp=derived, tp=tp, cp=cp, ep=ep, etp=etp)

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

    def sizes(self) -> Dict[str, int]:
        return {"dp": self.dp, "cp": self.cp, "tp": self.tp}

    def coords(self, rank: int) -> Dict[str, int]:
        """Role rank -> its dp, cp, tp coordinates (tp innermost)."""
        return {"dp": rank // (self.cp * self.tp), "cp": rank // self.tp % self.cp, "tp": rank % self.tp}

    def groups(self, dim: str) -> List[List[int]]:
        """Every group of role ranks along `dim` (the other coordinates fixed)."""
        grid = torch.arange(self.world).reshape(self.dp, self.cp, self.tp)
        axis = DENSE_DIMS.index(dim)
        moved = grid.movedim(axis, -1).reshape(-1, grid.shape[axis])
        return [row.tolist() for row in moved]

    def ep_groups(self) -> List[List[int]]:
        """Expert parallel groups: runs of ep x etp consecutive role ranks."""
        size = self.ep * self.etp
        return [list(range(s, s + size)) for s in range(0, self.world, size)]


def _subgroup(role_group, role_ranks: List[int], members: List[int]):
    """The process group of these role ranks; the role group itself when it is all of them."""
    if len(members) == len(role_ranks):
        return role_group
    return dist.new_group([role_ranks[m] for m in members], use_local_synchronization=True)


def build_mesh(dims: ParallelDims, group: Optional[dist.ProcessGroup], device_type: str = "cpu"):
    """A DeviceMesh with named dims ("dp", "cp", "tp") over `group`'s ranks (None: the
    default group). Dims of size 1 are kept, so `mesh["tp"]` always exists."""
    from torch.distributed.device_mesh import DeviceMesh

    group = group or dist.group.WORLD
    role_ranks = dist.get_process_group_ranks(group)
    if len(role_ranks) != dims.world:
        raise ValueError(f"parallel sizes {dims.sizes()} need {dims.world} ranks, the group has {len(role_ranks)}")
    me = role_ranks.index(dist.get_rank())
    mine = []
    for dim in DENSE_DIMS:
        # Every member creates only the groups it belongs to: with local synchronization the
        # other groups' members need not take part.
        own = next(g for g in dims.groups(dim) if me in g)
        mine.append(_subgroup(group, role_ranks, own))
    grid = torch.tensor(role_ranks, dtype=torch.int).reshape(dims.dp, dims.cp, dims.tp)
    return DeviceMesh.from_group(mine, device_type, mesh=grid, mesh_dim_names=DENSE_DIMS)

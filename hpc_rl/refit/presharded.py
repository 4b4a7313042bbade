"""Hand a tensor-parallel worker's slice to vLLM's weight loaders as if it were whole.

vLLM's loaders take the full Hugging Face tensor and cut out their rank's part with one
`narrow` (column-parallel rows, row-parallel columns, the vocabulary's padded split, each
q/k/v and gate/up member of a fused parameter). A refit delivers only that part. Wrapped
in `PreShardedWeight`, the slice reports the global shape, and the loader's `narrow` to
exactly this slice returns the slice itself: the loaders, their fused-member offsets and
vLLM's layerwise reload all run unchanged, and no rank ever holds a whole tensor.

A worker may hold several boxes of one tensor along the same dimension (Nemotron-H's
Mamba in_proj: its z, x, B, C and dt rows, models/families/nemotron_h/refit_layout.py). vLLM's loader
first narrows the whole to one part, then to its rank's rows of that part: a narrow that
contains whole boxes returns a wrapper of that range, a narrow to exactly what is held
returns the tensor.

With a single B/C group (n_groups == 1) vLLM's Mamba loader (mamba_mixer2.py
`mamba_v2_sharded_weight_loader`) takes each part by a slice along dim 0 (`loaded_weight[a:b]`):
a slice with no step reads as that narrow.

vLLM 0.32's MoE loader (fused_moe/routed_experts.py) gives a single expert's tensor a dummy
expert dimension and takes it off again (`loaded_weight.unsqueeze(0)`, then `.unbind()`)
before narrowing: that round trip hands back the wrapper itself.

Anything else done to the wrapper (a narrow to other rows, arithmetic, a copy of the
whole) raises, naming the tensor: our layout and vLLM's split disagree, and loading on
would corrupt the weights silently.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

_NARROW = {torch.Tensor.narrow, torch.narrow}
_UNSQUEEZE = {torch.Tensor.unsqueeze, torch.unsqueeze}
_UNBIND = {torch.Tensor.unbind, torch.unbind}


def _dim0_slice(index):
    """(start, stop) of an index that is a plain slice along dim 0 (`t[a:b]`, `t[a:b, ...]`), else None."""
    if isinstance(index, tuple) and len(index) == 2 and index[1] is Ellipsis:
        index = index[0]
    if isinstance(index, slice) and index.step in (None, 1) and index.start is not None and index.stop is not None:
        return int(index.start), int(index.stop)
    return None


class PreShardedWeight(torch.Tensor):
    """`local` is the box [start, start + local.shape) of a tensor of `global_shape`; it
    differs from the whole along exactly one dimension. `of_boxes` wraps several such
    boxes along the same dimension."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, global_shape: Sequence[int], start: Sequence[int], name: str = ""):
        return torch.Tensor._make_wrapper_subclass(cls, tuple(global_shape), dtype=local.dtype, device=local.device)

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int], start: Sequence[int], name: str = ""):
        split = [d for d, (n, g) in enumerate(zip(local.shape, global_shape)) if n != g]
        if len(split) != 1 or any(s for d, s in enumerate(start) if d not in split):
            raise ValueError(f"{name}: box {tuple(start)}+{tuple(local.shape)} of {tuple(global_shape)} is not a "
                             f"slice along one dimension")
        self._split, self._label = split[0], name
        self._rows: List[Tuple[int, torch.Tensor]] = [(int(start[split[0]]), local)]  # (first row, tensor), sorted

    @classmethod
    def of_boxes(cls, boxes: Sequence[Tuple[Sequence[int], torch.Tensor]], global_shape: Sequence[int],
                 name: str = "") -> "PreShardedWeight":
        """Several disjoint boxes (start, tensor), all slices along the same dimension."""
        boxes = sorted(boxes, key=lambda b: tuple(b[0]))
        out = cls(boxes[0][1], global_shape, boxes[0][0], name)
        for start, local in boxes[1:]:
            other = cls(local, global_shape, start, name)
            if other._split != out._split:
                raise ValueError(f"{name}: boxes split along dims {out._split} and {other._split}")
            out._rows += other._rows
        ends = [a + t.shape[out._split] for a, t in out._rows]
        if any(e > a for e, (a, _) in zip(ends, out._rows[1:])):
            raise ValueError(f"{name}: overlapping boxes {out._held()}")
        return out

    def _held(self) -> str:
        return ", ".join(f"{a}:{a + t.shape[self._split]}" for a, t in self._rows)

    def __repr__(self) -> str:
        return f"PreShardedWeight({self._label}: rows {self._held()} of dim {self._split}, global {tuple(self.shape)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NARROW and isinstance(args[0], PreShardedWeight):
            return args[0]._narrow(*args[1:], **kwargs)
        if func is torch.Tensor.__getitem__ and isinstance(args[0], PreShardedWeight) and _dim0_slice(args[1]):
            start, stop = _dim0_slice(args[1])
            return args[0]._narrow(0, start, stop - start)
        if func in _UNSQUEEZE and isinstance(args[0], PreShardedWeight):
            return args[0]._unsqueeze(*args[1:], **kwargs)
        if func in _UNBIND and isinstance(args[0], PreShardedWeight) and getattr(args[0], "_squeezed", None) is not None:
            dim = (list(args[1:]) + [kwargs.get("dim", 0)])[0]
            if int(dim) == 0:
                return (args[0]._squeezed,)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)  # metadata (shape, dtype, dim) answers from the wrapper

    def _unsqueeze(self, dim: int = 0) -> "PreShardedWeight":
        """A leading dimension of 1 (vLLM's dummy expert dimension), undone by `unbind(0)`."""
        if int(dim) != 0:
            raise RuntimeError(f"{self._label}: vLLM's loader unsqueezed dim {dim}; only the leading expert "
                               f"dimension (0) is supported on a pre-sharded weight")
        boxes = []
        for a, t in self._rows:
            start = [0] * (len(self.shape) + 1)
            start[self._split + 1] = a
            boxes.append((start, t.unsqueeze(0)))
        out = PreShardedWeight.of_boxes(boxes, (1,) + tuple(self.shape), self._label)
        out._squeezed = self
        return out

    def _covers(self, inside, start: int, stop: int) -> bool:
        """The held boxes `inside` cover rows start..stop without a gap."""
        at = start
        for a, t in inside:
            if a > at:
                return False
            at = max(at, a + t.shape[self._split])
        return at >= stop

    def _narrow(self, dim: int, start, length: int) -> torch.Tensor:
        dim, start, length = int(dim) % len(self.shape), int(start), int(length)
        stop = start + length
        inside = [(a, t) for a, t in self._rows if a < stop and a + t.shape[self._split] > start]
        whole = all(start <= a and a + t.shape[self._split] <= stop for a, t in inside)
        if dim == self._split and inside and self._covers(inside, start, stop):
            # rows this worker holds, whole boxes or part of one (a replicated B/C group merged
            # with its neighbours into one box): those rows themselves
            parts = [t.narrow(dim, max(start - a, 0), min(stop, a + t.shape[dim]) - max(start, a)) for a, t in inside]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        if dim != self._split or not inside or not whole:
            raise RuntimeError(
                f"{self._label}: vLLM's loader asked for rows {start}:{stop} of dim {dim}, this worker "
                f"received rows {self._held()} of dim {self._split}: the refit's destination "
                f"layout does not match the engine's tensor-parallel split")
        held = sum(t.shape[self._split] for _, t in inside)
        if held == length:  # exactly what this worker holds: the tensor itself
            return inside[0][1] if len(inside) == 1 else torch.cat([t for _, t in inside], dim=self._split)
        shape = list(self.shape)
        shape[dim] = length
        starts = [[0] * len(shape) for _ in inside]
        for st, (a, _) in zip(starts, inside):
            st[dim] = a - start
        return PreShardedWeight.of_boxes([(st, t) for st, (_, t) in zip(starts, inside)], shape, self._label)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        names = [a._label for a in args if isinstance(a, PreShardedWeight)]
        raise RuntimeError(f"{', '.join(names) or 'a pre-sharded weight'}: vLLM's loader applied {func} to the whole "
                           f"tensor, but this worker holds only its slice; only a narrow to that slice is supported")


def as_loader_weight(local: torch.Tensor, global_shape: Sequence[int], start: Sequence[int], name: str) -> torch.Tensor:
    """What a worker hands vLLM's loader for a received piece: the tensor itself when it
    is whole (TP 1, replicated parameters), otherwise the pre-sharded wrapper."""
    if tuple(local.shape) == tuple(global_shape):
        return local
    return PreShardedWeight(local, global_shape, start, name)


def as_loader_weight_of(boxes: Sequence[Tuple[Sequence[int], torch.Tensor]], global_shape: Sequence[int],
                        name: str) -> torch.Tensor:
    """The same for every box of one tensor a worker keeps (several for Nemotron-H's mixers)."""
    if len(boxes) == 1:
        return as_loader_weight(boxes[0][1], global_shape, boxes[0][0], name)
    return PreShardedWeight.of_boxes(boxes, global_shape, name)

"""Hand a tensor-parallel worker's slice to vLLM's weight loaders as if it were whole.

vLLM's loaders take the full Hugging Face tensor and cut out their rank's part with one
`narrow` (column-parallel rows, row-parallel columns, the vocabulary's padded split, each
q/k/v and gate/up member of a fused parameter). A refit delivers only that part. Wrapped
in `PreShardedWeight`, the slice reports the global shape, and the loader's `narrow` to
exactly this slice returns the slice itself: the loaders, their fused-member offsets and
vLLM's layerwise reload all run unchanged, and no rank ever holds a whole tensor.

Anything else done to the wrapper (a narrow to other rows, arithmetic, a copy of the
whole) raises, naming the tensor: our layout and vLLM's split disagree, and loading on
would corrupt the weights silently.
"""

from __future__ import annotations

from typing import Sequence

import torch

_NARROW = {torch.Tensor.narrow, torch.narrow}


class PreShardedWeight(torch.Tensor):
    """`local` is the box [start, start + local.shape) of a tensor of `global_shape`; it
    differs from the whole along exactly one dimension."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, global_shape: Sequence[int], start: Sequence[int], name: str = ""):
        return torch.Tensor._make_wrapper_subclass(cls, tuple(global_shape), dtype=local.dtype, device=local.device)

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int], start: Sequence[int], name: str = ""):
        split = [d for d, (n, g) in enumerate(zip(local.shape, global_shape)) if n != g]
        if len(split) != 1 or any(s for d, s in enumerate(start) if d not in split):
            raise ValueError(f"{name}: box {tuple(start)}+{tuple(local.shape)} of {tuple(global_shape)} is not a "
                             f"slice along one dimension")
        self._local, self._split, self._start, self._label = local, split[0], int(start[split[0]]), name

    def __repr__(self) -> str:
        return (f"PreShardedWeight({self._label}: rows {self._start}:{self._start + self._local.shape[self._split]} "
                f"of dim {self._split}, global {tuple(self.shape)})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NARROW and isinstance(args[0], PreShardedWeight):
            return args[0]._narrow(*args[1:], **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)  # metadata (shape, dtype, dim) answers from the wrapper

    def _narrow(self, dim: int, start, length: int) -> torch.Tensor:
        dim, start, length = int(dim) % len(self.shape), int(start), int(length)
        have = self._local.shape[self._split]
        if dim != self._split or start != self._start or length != have:
            raise RuntimeError(
                f"{self._label}: vLLM's loader asked for rows {start}:{start + length} of dim {dim}, this worker "
                f"received rows {self._start}:{self._start + have} of dim {self._split}: the refit's destination "
                f"layout does not match the engine's tensor-parallel split")
        return self._local

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

"""Where each byte of each weight lives, on the trainer side and on the vLLM side.

A layout is plain data keyed by Hugging Face parameter names: for every tensor its global
shape and dtype, and the boxes of it (a start and stop per dimension) that each rank
holds. Both sides build layouts without importing the other side's framework, and the
planner (planner.py) turns a pair of layouts into slice transfers.

Builders cover the common splits: even chunks along one dimension (FSDP2's Shard(0),
Megatron column/row tensor parallel, vLLM tensor parallel), experts spread over expert-
parallel ranks, layers over pipeline stages, and replicas (data parallel copies).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (start, stop), half-open per dimension

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


class LayoutError(ValueError):
    """A layout that cannot be used: names, shapes, dtypes or coverage are wrong."""


@dataclass(frozen=True)
class Piece:
    rank: int
    start: Tuple[int, ...]
    stop: Tuple[int, ...]

    def numel(self) -> int:
        n = 1
        for a, b in zip(self.start, self.stop):
            n *= max(b - a, 0)
        return n


@dataclass
class TensorLayout:
    name: str
    shape: Tuple[int, ...]
    dtype: str
    pieces: List[Piece] = field(default_factory=list)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass
class Layout:
    tensors: Dict[str, TensorLayout] = field(default_factory=dict)

    def ranks(self) -> List[int]:
        return sorted({p.rank for t in self.tensors.values() for p in t.pieces})

    def bytes_on(self, rank: int) -> int:
        return sum(p.numel() * t.itemsize for t in self.tensors.values() for p in t.pieces if p.rank == rank)

    def add(self, name: str, shape: Sequence[int], dtype: str, pieces: Iterable[Piece]) -> None:
        t = self.tensors.setdefault(name, TensorLayout(name, tuple(shape), dtype))
        t.pieces.extend(pieces)

    def to_dict(self) -> dict:
        return {n: {"shape": list(t.shape), "dtype": t.dtype,
                    "pieces": [[p.rank, list(p.start), list(p.stop)] for p in t.pieces]} for n, t in self.tensors.items()}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Layout":
        out = cls()
        for n, t in d.items():
            out.add(n, t["shape"], t["dtype"], [Piece(r, tuple(a), tuple(b)) for r, a, b in t["pieces"]])
        return out


# ------------------------------------------------------------------------------------ splits

def chunk_bounds(size: int, parts: int) -> List[Tuple[int, int]]:
    """torch.chunk's split of `size` into `parts`: ceil-sized chunks, the last ones may be
    short or empty (FSDP2's Shard(0) and vLLM's TP both divide evenly in practice)."""
    step = -(-size // parts)
    return [(min(i * step, size), min((i + 1) * step, size)) for i in range(parts)]


def split(shape: Sequence[int], dim: Optional[int], parts: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """Boxes of `shape` cut into `parts` along `dim` (None: every part is the whole tensor)."""
    full = (tuple(0 for _ in shape), tuple(shape))
    if dim is None:
        return [full] * parts
    out = []
    for a, b in chunk_bounds(shape[dim], parts):
        start, stop = list(full[0]), list(full[1])
        start[dim], stop[dim] = a, b
        out.append((tuple(start), tuple(stop)))
    return out


def sharded(specs: Mapping[str, Tuple[Sequence[int], str]], ranks: Sequence[int],
            dim_of: Callable[[str], Optional[int]]) -> Layout:
    """Every tensor cut along dim_of(name) over `ranks` (None: replicated on all of them)."""
    lay = Layout()
    for name, (shape, dtype) in specs.items():
        boxes = split(shape, dim_of(name), len(ranks))
        lay.add(name, shape, dtype, [Piece(r, a, b) for r, (a, b) in zip(ranks, boxes)])
    return lay


def fsdp2(specs: Mapping[str, Tuple[Sequence[int], str]], ranks: Sequence[int]) -> Layout:
    """FSDP2: Shard(0) of every parameter over the data-parallel ranks."""
    return sharded(specs, ranks, lambda name: 0)


_COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|embed_tokens|lm_head)\.weight$")
_ROW = re.compile(r"(o_proj|down_proj)\.weight$")


def megatron_tp_dim(name: str) -> Optional[int]:
    """Tensor-parallel split of a Llama-style HF name: column parallel (and vocab parallel)
    along dim 0, row parallel along dim 1, norms and biases-free rest replicated."""
    if _COLUMN.search(name):
        return 0
    if _ROW.search(name):
        return 1
    return None


def tensor_parallel(specs, ranks: Sequence[int]) -> Layout:
    return sharded(specs, ranks, megatron_tp_dim)


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def expert_parallel(specs, ranks: Sequence[int], num_experts: int, other: Optional[Callable] = None) -> Layout:
    """Experts (names with `.experts.<e>.`) spread over `ranks` in contiguous blocks of
    num_experts/len(ranks); every other tensor laid out by `other` (default: replicated)."""
    if num_experts % len(ranks):
        raise LayoutError(f"{num_experts} experts do not divide over {len(ranks)} expert-parallel ranks")
    per = num_experts // len(ranks)
    lay = Layout()
    rest = {}
    for name, (shape, dtype) in specs.items():
        m = _EXPERT.search(name)
        if m:
            owner = ranks[int(m.group(1)) // per]
            lay.add(name, shape, dtype, [Piece(owner, tuple(0 for _ in shape), tuple(shape))])
        else:
            rest[name] = (shape, dtype)
    other_lay = (other or (lambda s, r: sharded(s, r, lambda n: None)))(rest, ranks)
    lay.tensors.update(other_lay.tensors)
    return lay


def from_boxes(specs: Mapping[str, Tuple[Sequence[int], str]],
               boxes: Mapping[int, Mapping[str, Tuple[Sequence[int], Sequence[int]]]]) -> Layout:
    """The layout a backend reports: for each rank, name -> (start, local shape) of the box
    it holds (its `local_shards`). Any split works (FSDP2 chunks, expert blocks, replicas
    across expert data-parallel groups); coverage is checked against the destination."""
    lay = Layout()
    for rank in sorted(boxes):
        for name, (start, shape) in boxes[rank].items():
            if name not in specs:
                raise LayoutError(f"{name}: rank {rank} holds it, the refit specs do not name it")
            lay.add(name, specs[name][0], specs[name][1],
                    [Piece(rank, tuple(start), tuple(a + n for a, n in zip(start, shape)))])
    return lay


def merge(*layouts: Layout) -> Layout:
    """One layout from several (pipeline stages, replicas): pieces are concatenated."""
    out = Layout()
    for lay in layouts:
        for t in lay.tensors.values():
            existing = out.tensors.get(t.name)
            if existing is not None and (existing.shape != t.shape or existing.dtype != t.dtype):
                raise LayoutError(f"{t.name}: shape/dtype {t.shape}/{t.dtype} vs {existing.shape}/{existing.dtype}")
            out.add(t.name, t.shape, t.dtype, t.pieces)
    return out


# ---------------------------------------------------------------------------------- checks

def coverage_problems(t: TensorLayout) -> List[str]:
    """Boxes out of bounds, of the wrong rank, or elements no rank holds."""
    problems = []
    nd = len(t.shape)
    for p in t.pieces:
        if len(p.start) != nd or len(p.stop) != nd:
            problems.append(f"rank {p.rank}: a {len(p.start)}-d box for a {nd}-d tensor")
            continue
        if any(a < 0 or b > n or a > b for a, b, n in zip(p.start, p.stop, t.shape)):
            problems.append(f"rank {p.rank}: box {p.start}..{p.stop} outside shape {t.shape}")
    if problems:
        return problems
    # Elements held: the union of boxes must be the whole tensor. Check on the grid of cuts.
    cuts = [sorted({0, n} | {p.start[d] for p in t.pieces} | {p.stop[d] for p in t.pieces}) for d, n in enumerate(t.shape)]
    covered = set()
    index = [{v: i for i, v in enumerate(c)} for c in cuts]
    for p in t.pieces:
        ranges = [range(index[d][p.start[d]], index[d][p.stop[d]]) for d in range(nd)]
        covered.update(itertools.product(*ranges))
    total = 1
    for c in cuts:
        total *= len(c) - 1
    if len(covered) != total:
        missing = next(cell for cell in itertools.product(*[range(len(c) - 1) for c in cuts]) if cell not in covered)
        lo = tuple(cuts[d][i] for d, i in enumerate(missing))
        problems.append(f"no rank holds the elements from {lo} (cell of the layout's grid); the layout does not cover the tensor")
    return problems


def check_pair(src: Layout, dst: Layout) -> None:
    """Setup-time validation of a source/destination pair: the same names, shapes and
    dtypes on both sides, and both covering every tensor. Raises LayoutError listing all."""
    problems = []
    for name in sorted(set(dst.tensors) - set(src.tensors)):
        problems.append(f"{name}: the destination needs it, the source has no such parameter")
    for name in sorted(set(src.tensors) - set(dst.tensors)):
        problems.append(f"{name}: the source has it, the destination has no such parameter")
    for name in sorted(set(src.tensors) & set(dst.tensors)):
        s, d = src.tensors[name], dst.tensors[name]
        if s.shape != d.shape:
            problems.append(f"{name}: shape {s.shape} (source) vs {d.shape} (destination)")
        if s.dtype != d.dtype:
            problems.append(f"{name}: dtype {s.dtype} (source) vs {d.dtype} (destination)")
        for side, t in (("source", s), ("destination", d)):
            problems += [f"{name} ({side}): {p}" for p in coverage_problems(t)]
    if problems:
        raise LayoutError("refit layouts do not match:\n  " + "\n  ".join(problems))

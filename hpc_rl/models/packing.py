"""Sequence packing: several right-padded rows' tokens in one row, and back.

Why: RL rollouts vary tenfold in length; right-padding every row to the longest makes most
of a forward padding. Packed, a forward holds only real tokens: the samples of a micro-batch
are laid end to end in one row, each with its own position ids (0, 1, ...), and the model
sees where one sample ends by its position ids restarting (transformers builds a
block-diagonal causal mask from them when no attention mask is given, and its
variable-length attention reads them on GPUs; Mamba layers restart their state at the same
boundaries: models/mamba_segments.py).

Micro-batches are bins of at most `budget` tokens, filled first-fit by decreasing length
(a sample longer than the budget would get a bin of its own; validation keeps the budget at
least trainer.max_seq_len). The per-sample log-probs come back in the padded layout the loss
expects ([rows, width], 0 at position 0 and past each sample's end), so the loss and its
normalisation are the unpacked ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch


def row_lengths(attention_mask: torch.Tensor) -> List[int]:
    """Each right-padded row's token count; a mask that is not a prefix of ones is refused
    (packing keeps tokens by position, so a hole would shift every later token)."""
    lengths = [int(x) for x in attention_mask.sum(1)]
    for i, n in enumerate(lengths):
        if not bool(attention_mask[i, :n].all()):
            raise ValueError(f"packing needs right-padded rows; row {i}'s attention mask has holes")
    return lengths


def first_fit_bins(lengths: Sequence[int], budget: int) -> List[List[int]]:
    """Row indices grouped into bins of at most `budget` tokens (0: one bin of every row),
    first fit by decreasing length; each bin's rows in ascending order. Deterministic: every
    rank that packs the same lengths gets the same bins."""
    if not budget:
        return [list(range(len(lengths)))] if len(lengths) else []
    bins: List[List[int]] = []
    room: List[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return [sorted(b) for b in bins]


@dataclass
class PackedRow:
    """One packed row: `input_ids` / `position_ids` [1, L], and per sample its source row,
    offset in the packed row and length. `segments` are the samples' [start, end) spans (and
    a trailing pad span when the row was padded to a multiple)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    rows: List[int]
    offsets: List[int]
    lengths: List[int]
    segments: List[Tuple[int, int]]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def pack(input_ids: torch.Tensor, lengths: Sequence[int], rows: Sequence[int], multiple: int = 1,
         pad_id: int = 0) -> PackedRow:
    """The `rows` of right-padded `input_ids` [B, T] laid end to end in one row, padded to a
    multiple of `multiple` tokens (sequence parallel splits the row evenly) with a pad span of
    its own positions (it attends only to itself; its outputs are dropped)."""
    ids, pos, offsets, lens, segments = [], [], [], [], []
    at = 0
    for r in rows:
        n = int(lengths[r])
        ids.append(input_ids[r, :n])
        pos.append(torch.arange(n, dtype=torch.long))
        offsets.append(at)
        lens.append(n)
        segments.append((at, at + n))
        at += n
    extra = -at % multiple
    if extra:
        ids.append(input_ids.new_full((extra,), pad_id))
        pos.append(torch.arange(extra, dtype=torch.long))
        segments.append((at, at + extra))
    flat_ids = torch.cat(ids) if ids else input_ids.new_zeros((0,))
    flat_pos = torch.cat(pos) if pos else torch.zeros((0,), dtype=torch.long)
    return PackedRow(flat_ids[None], flat_pos[None].to(input_ids.device), list(rows), offsets, lens, segments)


def unpack(p: PackedRow, lp: torch.Tensor, width: int) -> torch.Tensor:
    """The packed row's log-probs [1, L] in hpc_rl's convention (position i: log p(token i |
    the row's tokens < i)) -> [rows, width] of the samples: out[k, i] = log p(token i | sample
    k's tokens < i), 0 at i = 0 and past its end. A sample's first position is dropped (in the
    packed row it is predicted from the previous sample). Gradients flow through."""
    out = lp.new_zeros((len(p.rows), width))
    for k, (o, n) in enumerate(zip(p.offsets, p.lengths)):
        if n > 1:
            out[k, 1:n] = lp[0, o + 1:o + n]
    return out

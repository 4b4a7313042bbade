"""Sequence packing: several right-padded rows' tokens in one row, and back.

Why: RL rollouts vary tenfold in length; right-padding every row to the longest makes most
of a forward padding. Packed, a forward holds only real tokens: the samples of a micro-batch
are laid end to end in one row, each with its own position ids (0, 1, ...), and the model
sees where one sample ends by its position ids restarting (transformers builds a
block-diagonal causal mask from them when no attention mask is given, and its
variable-length attention reads them on GPUs; Mamba layers restart their state at the same
boundaries: models/mamba_segments.py).

Packed rows are at most as long as the batch's longest sample (its padded width), filled
first-fit by decreasing length, so no packed row's attention is longer than a padded row's
(a row of every sample would make attention, quadratic in the row, cost more than the padding
it saves: measured on 64 samples of ~37 tokens in rows of 1024). A micro-batch is as many
packed rows as fit `budget` tokens (rows x the longest of them; at least one row). The
per-sample log-probs come back in the padded layout the loss expects ([samples, width], 0 at
position 0 and past each sample's end), so the loss and its normalisation are the unpacked ones.
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
    """Sample indices grouped into bins of at most `budget` tokens (0: one bin of every
    sample), first fit by decreasing length, the fullest bins first (in creation order, which
    first fit by decreasing length keeps about decreasing in fill); each bin's samples in
    ascending order. Deterministic: every rank that packs the same lengths gets the same bins."""
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
class PackedBatch:
    """Packed rows `input_ids` / `position_ids` [R, L] and, per sample (`samples`: indices of
    the source batch), its packed row, offset and length. `spans[r]` are row r's [start, end)
    sample spans, with a trailing pad span of its own positions where the row is shorter than L
    (a span attends only to itself; its outputs are dropped)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    samples: List[int]
    places: List[Tuple[int, int, int]]  # (packed row, offset, length) per sample
    spans: List[List[Tuple[int, int]]]

    @property
    def tokens(self) -> int:
        return sum(n for _, _, n in self.places)

    @property
    def forward_tokens(self) -> int:
        return self.input_ids.numel()


def pack(input_ids: torch.Tensor, lengths: Sequence[int], rows: Sequence[Sequence[int]], multiple: int = 1,
         pad_id: int = 0) -> PackedBatch:
    """Each list of `rows` (sample indices of right-padded `input_ids` [B, T]) laid end to end
    in one packed row; rows padded to the longest, rounded up to a multiple of `multiple`."""
    fills = [sum(int(lengths[i]) for i in r) for r in rows]
    width = max(fills, default=1)
    width += -width % multiple
    ids = input_ids.new_full((len(rows), width), pad_id)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    samples, places, spans = [], [], []
    for r, row in enumerate(rows):
        at, row_spans = 0, []
        for i in row:
            n = int(lengths[i])
            ids[r, at:at + n] = input_ids[i, :n]
            pos[r, at:at + n] = torch.arange(n)
            samples.append(int(i))
            places.append((r, at, n))
            row_spans.append((at, at + n))
            at += n
        if at < width:
            pos[r, at:] = torch.arange(width - at)
            row_spans.append((at, width))
        spans.append(row_spans)
    return PackedBatch(ids, pos.to(input_ids.device), samples, places, spans)


def micro_batches(lengths: Sequence[int], row_tokens: int, budget: int) -> List[List[List[int]]]:
    """The packed micro-batches of a batch: samples first-fit into rows of at most `row_tokens`
    tokens, then consecutive rows while (rows x the longest of them) stays within `budget`
    tokens (0: every row in one micro-batch); each micro-batch at least one row."""
    rows = first_fit_bins(lengths, row_tokens)
    if not budget:
        return [rows] if rows else []
    out: List[List[List[int]]] = []
    longest = 0
    for row in rows:
        fill = sum(int(lengths[i]) for i in row)
        if out and (len(out[-1]) + 1) * max(longest, fill) <= budget:
            out[-1].append(row)
            longest = max(longest, fill)
        else:
            out.append([row])
            longest = fill
    return out


def unpack(p: PackedBatch, lp: torch.Tensor, width: int) -> torch.Tensor:
    """The packed rows' log-probs [R, L] in hpc_rl's convention (position i: log p(token i |
    the row's tokens < i)) -> [samples, width]: out[k, i] = log p(token i | sample k's tokens
    < i), 0 at i = 0 and past its end. A sample's first position is dropped (in the packed row
    it is predicted from the previous sample). Gradients flow through."""
    out = lp.new_zeros((len(p.samples), width))
    for k, (r, o, n) in enumerate(p.places):
        if n > 1:
            out[k, 1:n] = lp[r, o + 1:o + n]
    return out

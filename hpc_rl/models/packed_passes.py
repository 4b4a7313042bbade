"""The fsdp2 backend's forwards over packed rows (trainer.packing; models/packing.py): the
no-grad log-prob pass in rows of at most `logprob_batch_tokens` tokens, and the train step's
micro-batches of at most `micro_batch_tokens` tokens, each one packed row.

Every rank of a group runs as many forwards (FSDP2's all-gathers and reduce-scatters are
collectives of the group): the count is agreed, and a rank with fewer micro-batches runs a
spare one (its first sample again, its output dropped, a zero loss in the train step so its
backward joins the others' gradient reductions with nothing added).
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .chunked_logprobs import next_token_logprobs, token_logprobs
from .mamba_segments import segments
from .packing import PackedRow, first_fit_bins, pack, row_lengths, unpack

# the backend: models/fsdp2.FSDP2Backend (which imports this module; named only in words here)
Backend = Any


def agreed_count(backend: Backend, count: int) -> int:
    """The most forwards any rank of the backend's group needs."""
    if not backend.sharded:
        return count
    t = torch.tensor([count], device=backend.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=backend.group)
    return int(t)


def packed_rows_logprobs(backend: Backend, p: PackedRow, width: int) -> torch.Tensor:
    """[samples, width] log-probs (padded convention) of one packed row's samples, through
    the backend's head (in chunks, or whole logits when logprob_chunk_tokens is 0); with
    gradients when grad mode is on. Mamba mixers restart at each sample (mamba_segments.py)."""
    ids, pos = p.input_ids.to(backend.device), p.position_ids.to(backend.device)
    with backend._autocast():
        if backend.chunk_tokens != 0:
            lp = next_token_logprobs(backend.model, ids, None, backend.chunk_tokens, position_ids=pos)
        else:
            lp = token_logprobs(backend.model(input_ids=ids, position_ids=pos, use_cache=False).logits, ids)
    return unpack(p, lp, width)


def _spare(input_ids: torch.Tensor, lengths: List[int]) -> PackedRow:
    """A forward for a rank with no rows left: its first sample (or one token)."""
    if lengths:
        return pack(input_ids, lengths, [0])
    return pack(input_ids.new_zeros((1, 1)), [1], [0])


@torch.no_grad()
def logprob_pass(backend: Backend, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] log-probs of right-padded rows, packed into forwards of at most the backend's
    `batch_tokens` tokens (0: every row in one packed forward)."""
    n, width = input_ids.shape
    lengths = row_lengths(attention_mask)
    bins = first_fit_bins(lengths, backend.batch_tokens)
    out = torch.zeros((n, width), device=backend.device)
    for k in range(agreed_count(backend, len(bins))):
        p = pack(input_ids, lengths, bins[k]) if k < len(bins) else _spare(input_ids, lengths)
        with segments(backend.model, [p.segments]):
            lp = packed_rows_logprobs(backend, p, width)
        if k < len(bins):
            out[torch.tensor(p.rows, device=out.device)] = lp.to(out.dtype)
    return out


def train_micro_batches(backend: Backend, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor) -> Iterator[Tuple[Optional[torch.Tensor], PackedRow]]:
    """The train step's packed micro-batches: (the rows it holds, the packed row); rows None
    for a spare forward (a zero loss)."""
    lengths = row_lengths(attention_mask)
    bins = first_fit_bins(lengths, backend.micro_batch_tokens)
    for k in range(agreed_count(backend, len(bins))):
        if k < len(bins):
            yield torch.tensor(bins[k], dtype=torch.long), pack(input_ids, lengths, bins[k])
        else:
            yield None, _spare(input_ids, lengths)

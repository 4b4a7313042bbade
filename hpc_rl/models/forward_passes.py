"""The fsdp2 backend's passes over a rank's rows: the no-grad log-prob pass in forwards of
at most `logprob_batch_tokens` tokens, and the train step's micro-batches, either padded rows
(`micro_batch_size` rows each) or packed (trainer.packing; models/packing.py: micro-batches of
at most `micro_batch_tokens` tokens, each a few packed rows no longer than the batch's longest
sample).

Every rank of a group runs as many forwards (FSDP2's all-gathers and reduce-scatters are
collectives of the group): the count is agreed, and a rank with fewer micro-batches runs a
spare one (its first sample again, its output dropped, a zero loss in the train step so its
backward joins the others' gradient reductions with nothing added).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .chunked_logprobs import next_token_logprobs, token_logprobs
from .mamba_segments import segments
from .packing import PackedBatch, micro_batches, pack, row_lengths, unpack

# the backend: models/fsdp2.FSDP2Backend (which imports this module; named only in words here)
Backend = Any


def agreed_count(backend: Backend, count: int) -> int:
    """The most forwards any rank of the backend's group needs."""
    if not backend.sharded:
        return count
    t = torch.tensor([count], device=backend.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=backend.group)
    return int(t)


def packed_rows_logprobs(backend: Backend, p: PackedBatch, width: int) -> torch.Tensor:
    """[samples, width] log-probs (padded convention) of a packed micro-batch's samples, through
    the backend's head (in chunks, or whole logits when logprob_chunk_tokens is 0); with
    gradients when grad mode is on. Mamba mixers restart at each sample (mamba_segments.py)."""
    ids, pos = p.input_ids.to(backend.device), p.position_ids.to(backend.device)
    with backend._autocast():
        if backend.chunk_tokens != 0:
            lp = next_token_logprobs(backend.model, ids, None, backend.chunk_tokens, position_ids=pos)
        else:
            lp = token_logprobs(backend.model(input_ids=ids, position_ids=pos, use_cache=False).logits, ids)
    return unpack(p, lp, width)


def _spare(input_ids: torch.Tensor, lengths: List[int]) -> PackedBatch:
    """A forward for a rank with no rows left: its first sample (or one token)."""
    if lengths:
        return pack(input_ids, lengths, [[0]])
    return pack(input_ids.new_zeros((1, 1)), [1], [[0]])


@torch.no_grad()
def padded_logprob_pass(backend: Backend, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] log-probs of right-padded rows, in forwards of max(1, batch_tokens // T) rows
    (batch_tokens 0: every row at once)."""
    n, t = input_ids.shape
    rows = n if not backend.batch_tokens else max(1, backend.batch_tokens // max(t, 1))
    count = agreed_count(backend, -(-n // rows) if n else 0)
    if count <= 1 and n:
        return backend.forward_logprobs(input_ids, attention_mask)
    out = []
    for k in range(count):
        part = slice(k * rows, min((k + 1) * rows, n))
        if part.start < n:
            out.append(backend.forward_logprobs(input_ids[part], attention_mask[part]))
        else:  # a forward the other ranks run; its output is no row of ours
            spare = (input_ids[:1], attention_mask[:1]) if n else (input_ids.new_zeros((1, t)),
                                                                   attention_mask.new_ones((1, t)))
            backend.forward_logprobs(*spare)
    if not n:
        return torch.zeros((0, t), device=backend.device)
    return torch.cat(out)


@torch.no_grad()
def packed_logprob_pass(backend: Backend, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] log-probs of right-padded rows, packed into forwards of at most the backend's
    `batch_tokens` tokens (0: every row in one packed forward)."""
    n, width = input_ids.shape
    lengths = row_lengths(attention_mask)
    parts = micro_batches(lengths, width, backend.batch_tokens)
    out = torch.zeros((n, width), device=backend.device)
    for k in range(agreed_count(backend, len(parts))):
        p = pack(input_ids, lengths, parts[k]) if k < len(parts) else _spare(input_ids, lengths)
        with segments(backend.model, p.spans):
            lp = packed_rows_logprobs(backend, p, width)
        if k < len(parts):
            out[torch.tensor(p.samples, device=out.device)] = lp.to(out.dtype)
    return out


# (rows of the batch, or None for a spare forward; a context giving their [rows, T] log-probs
# with gradients, held open over the backward; the forward's token count)
MicroBatch = Tuple[Any, Callable[[], ContextManager[torch.Tensor]], int]


def train_micro_batches(backend: Backend, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        micro_batch_size: Optional[int]) -> Iterator[MicroBatch]:
    """The train step's micro-batches: `micro_batch_size` rows at a time (None: all), or with
    packing the packed micro-batches of at most micro_batch_tokens tokens. The context spans
    the backward too: with activation checkpointing the recomputed Mamba mixers keep their
    sample spans."""
    width = input_ids.shape[1]
    if backend.packing:
        lengths = row_lengths(attention_mask)
        parts = micro_batches(lengths, width, backend.micro_batch_tokens)
        for k in range(agreed_count(backend, len(parts))):
            p = pack(input_ids, lengths, parts[k]) if k < len(parts) else _spare(input_ids, lengths)
            rows = torch.tensor(p.samples, dtype=torch.long) if k < len(parts) else None
            yield rows, (lambda p=p: _spans_and(backend.model, p.spans, lambda: packed_rows_logprobs(backend, p, width))), \
                p.forward_tokens
        return
    n = input_ids.shape[0]
    mbs = max(n, 1) if not micro_batch_size or micro_batch_size >= n else micro_batch_size
    for k in range(agreed_count(backend, -(-n // mbs))):
        rows = slice(k * mbs, min((k + 1) * mbs, n))
        if rows.start >= n:  # a spare forward of this rank's first row
            rows, tokens = None, 0
            ids, mask = input_ids[:1], attention_mask[:1]
        else:
            ids, mask, tokens = input_ids[rows], attention_mask[rows], (rows.stop - rows.start) * width
        yield rows, (lambda ids=ids, mask=mask: _plain(lambda: backend.forward_logprobs(ids, mask))), tokens


@contextlib.contextmanager
def _plain(run):
    yield run()


@contextlib.contextmanager
def _spans_and(model, spans, run):
    with segments(model, spans):
        yield run()

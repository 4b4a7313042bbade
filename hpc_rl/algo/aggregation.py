"""How per-token losses become one minibatch loss, named as verl and the DAPO / Dr. GRPO
papers name them:

  token-mean           sum over every trained token / their number: each token weighs alike,
                       so long answers count by their length (DAPO; NeMo RL token_level_loss=true);
  seq-mean-token-mean  each sequence's mean over its tokens, then the mean over sequences: each
                       sequence one vote whatever its length (GRPO's paper; GSPO; NeMo RL
                       token_level_loss=false);
  seq-mean-token-sum   each sequence's sum over its tokens, then the mean over sequences (no
                       length normalisation inside a sequence, as Dr. GRPO argues).

A minibatch is trained in micro-batches (and split over data-parallel ranks): each
micro-batch contributes its part of the numerator divided by the minibatch share's whole
denominator (`denominator`), so the accumulated gradient equals the one-piece loss's.
A sequence with no trained token (masked out by a filter) is not counted.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["AGGREGATIONS", "aggregate", "denominator"]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _check(mode: str) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")


def denominator(mask: torch.Tensor, mode: str) -> int:
    """What the numerator of `mask`'s rows is divided by: trained tokens (token-mean) or
    sequences with a trained token (the seq-mean modes); at least 1."""
    _check(mode)
    keep = mask.bool()
    n = keep.sum() if mode == "token-mean" else keep.any(dim=-1).sum()
    return max(int(n), 1)


def aggregate(loss_t: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              denom: Optional[int] = None) -> torch.Tensor:
    """[B, T] per-token losses -> scalar: the mode's numerator over these rows / `denom`
    (None: these rows' own denominator). Values outside `mask` are selected away, never
    multiplied, so a nan in padding cannot leak in."""
    _check(mode)
    keep = mask.bool()
    x = torch.where(keep, loss_t, torch.zeros((), dtype=loss_t.dtype, device=loss_t.device))
    if mode == "token-mean":
        num = x.sum()
    elif mode == "seq-mean-token-mean":
        num = (x.sum(dim=-1) / keep.sum(dim=-1).clamp(min=1)).sum()
    else:
        num = x.sum()  # the sum over sequences of each sequence's token sum
    return num / (denom if denom is not None else denominator(mask, mode))

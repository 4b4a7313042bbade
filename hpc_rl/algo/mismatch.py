"""Corrections for the train/inference mismatch.

vLLM samples with its own kernels and precision, so its log-prob of a sampled token
differs from the trainer's recomputation even with identical weights. Left alone, the
"on-policy" gradient is silently off-policy; these helpers measure the gap and correct
it per token (truncated importance sampling, IcePop) or drop sequences where it is large.
"""

from __future__ import annotations

from typing import Optional

import torch

from .metrics import masked_mean

__all__ = ["importance_weights", "mult_prob_error_per_seq", "sequence_keep_mask"]

_KINDS = ("tis", "icepop", "none")


@torch.no_grad()
def importance_weights(
    trainer_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "tis",
    min: float = 0.0,
    max: float = 2.0,
) -> torch.Tensor:
    """Per-token weights pi_trainer / pi_generation for the loss, [B, T], detached.

    kind="tis" (truncated IS): clamp the ratio to [min, max], correcting the bias while
      bounding the variance a rare token could add.
    kind="icepop": keep the ratio where it lies in [min, max] and zero it outside, i.e.
      drop the gradient of tokens where the two engines disagree too much to trust.
    kind="none": ones (no correction).
    Always zero outside `mask`.
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown importance weight kind {kind!r}; expected one of {_KINDS}")
    if min > max:
        raise ValueError(f"importance weight bounds need min <= max, got [{min}, {max}]")
    keep = mask.bool()
    if kind == "none":
        return keep.float()
    log_ratio = trainer_logprobs.float() - generation_logprobs.float()
    ratio = torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))
    if kind == "tis":
        w = ratio.clamp(min, max)
    else:
        w = torch.where((ratio >= min) & (ratio <= max), ratio, torch.zeros_like(ratio))
    return torch.where(keep, w, torch.zeros_like(w))


@torch.no_grad()
def mult_prob_error_per_seq(
    trainer_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Per sequence, the mean over its masked tokens of exp(|delta logprob|), [B], >= 1.

    A symmetric multiplicative error: 1.0 means the engines agree exactly. A sequence with
    no trained token reports 1.0 (no evidence of a mismatch).
    """
    delta = (trainer_logprobs.float() - generation_logprobs.float()).abs()
    err = masked_mean(torch.exp(delta), mask, dim=1)
    has_tokens = mask.bool().any(dim=1)
    return torch.where(has_tokens, err, torch.ones_like(err))


@torch.no_grad()
def sequence_keep_mask(
    trainer_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    mask: torch.Tensor,
    threshold: Optional[float],
) -> torch.Tensor:
    """[B] bool: False for sequences whose mean multiplicative probability error exceeds
    `threshold` (None keeps all).

    Token-level weights cannot rescue a sequence whose whole trajectory diverged (e.g. a
    long generation that drifted after a numerics glitch); such sequences are masked out
    entirely: multiply the token mask by this before computing the loss.
    """
    n = trainer_logprobs.shape[0]
    if threshold is None:
        return torch.ones(n, dtype=torch.bool, device=trainer_logprobs.device)
    if threshold < 1.0:
        raise ValueError(f"threshold is a multiplicative error and must be >= 1, got {threshold}")
    return mult_prob_error_per_seq(trainer_logprobs, generation_logprobs, mask) <= threshold

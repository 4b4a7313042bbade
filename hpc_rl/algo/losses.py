"""Policy-gradient losses shared by OPD and GRPO.

Both algorithms reduce to "maximise A_t * log pi(y_t)" with different advantages; the
per-token loss here is the same for both, with a token-level importance ratio (PPO) or
GSPO's sequence-level one, and aggregation.py makes it one number.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .aggregation import aggregate
from .metrics import masked_mean

__all__ = ["policy_loss", "policy_loss_tokens", "RATIO_LEVELS"]

_KINDS = ("ppo", "reinforce")
RATIO_LEVELS = ("token", "sequence")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: Optional[torch.Tensor],
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *args,
    aggregation: str = "token-mean",
    denom: Optional[int] = None,
    **kwargs,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """policy_loss_tokens (same arguments) aggregated (aggregation.py) -> (scalar loss, metrics)."""
    loss_t, metrics = policy_loss_tokens(logprobs, old_logprobs, advantages, mask, *args, **kwargs)
    return aggregate(loss_t, mask, aggregation, denom), metrics


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's log s_i = mean over the sequence's masked tokens of log pi - log pi_old, [B, 1]
    broadcastable (0 for a sequence without a masked token). Differentiable in `logprobs`."""
    keep = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    diff = torch.where(keep, logprobs - old_logprobs.detach().to(logprobs.dtype), zero)
    return (diff.sum(dim=-1) / keep.sum(dim=-1).clamp(min=1))[:, None]


def policy_loss_tokens(
    logprobs: torch.Tensor,
    old_logprobs: Optional[torch.Tensor],
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    weights: Optional[torch.Tensor] = None,
    ratio_level: str = "token",
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Per-token policy-gradient losses [B, T] (0 outside `mask`) -> (loss_t, metrics).

    kind="ppo": ratio = exp(logprobs - old_logprobs) and
        loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A).
      Separate bounds ("clip-higher", DAPO) let a larger `clip_high` keep raising
      low-probability tokens with positive advantage, which fights entropy collapse,
      while `clip_low` still bounds how far a bad token is pushed down per step.
    kind="reinforce": loss_t = -A * logprobs, for strictly on-policy steps where the
      ratio is 1 and clipping would be a no-op (`old_logprobs` may be None).
    ratio_level="sequence" (ppo only): GSPO (arXiv 2507.18071): every token of sequence i
      takes the ratio s_i = exp(mean_t(log pi - log pi_old)) (sequence_log_ratio), clipped
      as a whole; the gradient reaches each token through the mean. Its clip bounds are
      the paper's 3e-4 / 4e-4 scale, not PPO's 0.2.

    `advantages` is [B, T] (a [B] one is broadcast over the mask). `weights` [B, T] are
    importance-sampling corrections for the train/inference mismatch (see mismatch.py)
    and multiply loss_t. Advantages, old log-probs and weights are detached: the gradient
    flows through `logprobs` only.

    Metrics: "num_tokens", "ratio_mean" and, for ppo, "clip_frac" (tokens whose gradient
    the clip removed) split into "clip_frac_low" / "clip_frac_high".
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown policy loss kind {kind!r}; expected one of {_KINDS}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio level {ratio_level!r}; expected one of {RATIO_LEVELS}")
    keep = mask.bool()
    adv = advantages.detach()
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logprobs)
    adv = adv.to(logprobs.dtype)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    metrics: Dict[str, float] = {"num_tokens": float(keep.sum())}

    if kind == "ppo":
        if old_logprobs is None:
            raise ValueError("kind='ppo' needs old_logprobs")
        if clip_low < 0 or clip_high < 0 or clip_low >= 1:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
        # Zero the log-ratio outside the mask before exp: padding may hold any value and
        # an inf there would turn the masked sum into nan through 0 * inf in the backward.
        if ratio_level == "sequence":
            log_ratio = torch.where(keep, sequence_log_ratio(logprobs, old_logprobs, keep).expand_as(logprobs), zero)
        else:
            log_ratio = torch.where(keep, logprobs - old_logprobs.detach().to(logprobs.dtype), zero)
        ratio = torch.exp(log_ratio)
        surr = ratio * adv
        surr_clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
        loss_t = -torch.minimum(surr, surr_clipped)
        with torch.no_grad():
            clipped = keep & (surr_clipped < surr)
            metrics["clip_frac"] = float(masked_mean(clipped.float(), keep))
            metrics["clip_frac_low"] = float(masked_mean((clipped & (ratio < 1.0)).float(), keep))
            metrics["clip_frac_high"] = float(masked_mean((clipped & (ratio > 1.0)).float(), keep))
            metrics["ratio_mean"] = float(masked_mean(ratio.float(), keep))
    else:
        loss_t = -adv * torch.where(keep, logprobs, zero)
        metrics["ratio_mean"] = 1.0 if bool(keep.any()) else 0.0

    if weights is not None:
        loss_t = loss_t * weights.detach().to(loss_t.dtype)
    return torch.where(keep, loss_t, zero), metrics

"""Token-level policy-gradient losses shared by OPD and GRPO.

Both algorithms reduce to "maximise A_t * log pi(y_t)" with different advantages; the
loss here is the same for both, averaged over every trained token of the batch.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .metrics import masked_mean

__all__ = ["policy_loss"]

_KINDS = ("ppo", "reinforce")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: Optional[torch.Tensor],
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Policy-gradient loss over masked tokens -> (scalar loss, metrics).

    kind="ppo": ratio = exp(logprobs - old_logprobs) and
        loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A).
      Separate bounds ("clip-higher", DAPO) let a larger `clip_high` keep raising
      low-probability tokens with positive advantage, which fights entropy collapse,
      while `clip_low` still bounds how far a bad token is pushed down per step.
    kind="reinforce": loss_t = -A * logprobs, for strictly on-policy steps where the
      ratio is 1 and clipping would be a no-op (`old_logprobs` may be None).

    `advantages` is [B, T] (a [B] one is broadcast over the mask). `weights` [B, T] are
    importance-sampling corrections for the train/inference mismatch (see mismatch.py)
    and multiply loss_t. Advantages, old log-probs and weights are detached: the gradient
    flows through `logprobs` only. The loss is sum over masked tokens / their number.

    Metrics: "num_tokens", "ratio_mean" and, for ppo, "clip_frac" (tokens whose gradient
    the clip removed) split into "clip_frac_low" / "clip_frac_high".
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown policy loss kind {kind!r}; expected one of {_KINDS}")
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
    return masked_mean(loss_t, keep), metrics

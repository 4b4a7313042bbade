"""Advantages for on-policy distillation (OPD / MOPD) and GRPO.

All advantages are constants for the loss: they are computed without autograd so that
the policy gradient flows only through the trainer's current log-probs.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["opd_advantages", "grpo_advantages", "per_token"]


@torch.no_grad()
def opd_advantages(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    baseline: str = "none",
) -> torch.Tensor:
    """Per-token OPD advantage A_t = sg[log p_teacher(y_t) - log p_student_prev(y_t)].

    With y_t sampled from the student, -A_t is the per-token reverse KL, so a policy
    gradient with this advantage descends KL(student || teacher): tokens the teacher likes
    more than the student are pushed up, the others down. The clip to [-clip, clip] bounds
    the step where the teacher assigns a near-zero probability (log-prob of -30 would
    otherwise dominate a batch). baseline="token_mean" then subtracts the mean over the
    masked tokens. Zero outside `mask`. Returns float32 [B, T].
    """
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    if baseline not in ("none", "token_mean"):
        raise ValueError(f"unknown OPD baseline {baseline!r}; expected 'none' or 'token_mean'")
    keep = mask.bool()
    adv = (teacher_logprobs.detach().float() - student_logprobs.detach().float()).clamp(-clip, clip)
    if baseline == "token_mean" and bool(keep.any()):
        # Variance reduction: E[b * grad log p] = 0 for a constant b, so the expected
        # gradient (of the per-token reverse KL) is unchanged.
        adv = adv - adv[keep].mean()
    return torch.where(keep, adv, torch.zeros_like(adv))


@torch.no_grad()
def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    leave_one_out: bool = False,
    normalize_std: bool = True,
    eps: float = 1e-6,
    clip: Tuple[Optional[float], Optional[float]] = (None, None),
) -> torch.Tensor:
    """Group-relative advantages for GRPO, [B] -> [B] float32.

    `rewards` holds consecutive groups of `group_size` samples of one prompt. The baseline
    is the group mean, or with `leave_one_out` the mean of the other G-1 samples (RLOO: the
    baseline is then independent of the sample it judges, so the estimate is unbiased;
    it equals G/(G-1) times the mean-centred reward). With `normalize_std` the result is
    divided by the group's reward std (unbiased, Bessel-corrected, as in TRL / NeMo-RL)
    plus `eps`, which puts easy and hard prompts on one scale. A group whose samples all
    earned the same reward gives zeros: it carries no signal. `clip` = (low, high) clamps the
    result after the std (None: that side open), as NeMo RL's advantage_clip_low/high: a
    group with one success among many failures gets a large advantage under the std, and
    the clip bounds that sample's step.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a group baseline, got {group_size}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(
            f"batch of {n} rewards is not a multiple of group_size={group_size}: "
            "rewards must be laid out as whole consecutive groups per prompt"
        )
    r = rewards.detach().float().view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    if leave_one_out:
        baseline = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    else:
        baseline = mean
    adv = r - baseline
    if normalize_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    low, high = clip
    if low is not None or high is not None:
        adv = adv.clamp(min=low, max=high)
    return adv.reshape(-1)


def per_token(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sample advantage [B] over the sample's masked tokens -> [B, T].

    GRPO scores whole sequences; the token-level loss needs the same value at every
    trained token and zero elsewhere.
    """
    if adv.dim() != 1 or adv.shape[0] != mask.shape[0]:
        raise ValueError(f"adv must be [B]={mask.shape[0]}, got shape {tuple(adv.shape)}")
    return adv.detach()[:, None] * mask.to(adv.dtype)

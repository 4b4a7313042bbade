"""Masked reductions and the diagnostics logged every step.

Every quantity here is a mean over the trained tokens of a right-padded [B, T] batch, so
padding, prompt tokens and position 0 (which has no prediction) never leak into a number.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

__all__ = ["masked_mean", "token_mult_prob_error", "reverse_kl_per_teacher", "entropy_from_logits"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is set (bool or 0/1 float).

    Token-level losses average over all masked tokens of the batch, so long sequences weigh
    by their length rather than being squashed to one vote each. Values outside the mask are
    selected away (not multiplied by 0) so an inf or nan in padding cannot poison the
    result. An empty mask gives 0 rather than nan: a step whose every sample was filtered
    out must contribute nothing, not crash the optimizer. With `dim`, reduce along that
    dimension only (empty rows give 0 as well).
    """
    keep = mask.bool()
    x = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return x.sum() / keep.sum().clamp(min=1).to(x.dtype)
    return x.sum(dim) / keep.sum(dim).clamp(min=1).to(x.dtype)


@torch.no_grad()
def token_mult_prob_error(a_logprobs: torch.Tensor, b_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over masked tokens of exp(|a - b|): the multiplicative error between two
    engines' probabilities of the same sampled token (1.0 means identical).

    This is the standard health check of train/inference mismatch (vLLM vs. trainer):
    a value drifting above ~1.01-1.05 flags a broken refit, a precision problem or a
    kernel divergence long before the reward curve shows it.
    """
    delta = (a_logprobs.float() - b_logprobs.float()).abs()
    return float(masked_mean(torch.exp(delta), mask))


@torch.no_grad()
def reverse_kl_per_teacher(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    teacher_index: torch.Tensor,
    teacher_names: Sequence[str],
) -> Dict[str, float]:
    """Sampled-token estimate of KL(student || teacher) per teacher, plus "mean".

    The tokens are sampled from the student, so mean(log p_student - log p_teacher) over
    them is an unbiased estimate of the reverse KL that OPD minimises. In multi-teacher
    OPD each sample is scored by the teacher of its task (`teacher_index[b]` indexes
    `teacher_names`); the estimate is computed separately per teacher, since averaging a
    math teacher's KL with a chat teacher's hides which distillation is lagging. Teachers
    with no trained token in the batch are left out; "mean" averages over every masked
    token of the batch.
    """
    names = list(teacher_names)
    if "mean" in names:
        raise ValueError("teacher name 'mean' is reserved for the all-token average")
    if teacher_index.dim() != 1 or teacher_index.shape[0] != student_logprobs.shape[0]:
        raise ValueError(f"teacher_index must be [B]={student_logprobs.shape[0]}, got {tuple(teacher_index.shape)}")
    if teacher_index.numel() and (int(teacher_index.min()) < 0 or int(teacher_index.max()) >= len(names)):
        raise ValueError(f"teacher_index values must lie in [0, {len(names)}), got {teacher_index.tolist()}")
    diff = student_logprobs.float() - teacher_logprobs.float()
    keep = mask.bool()
    out: Dict[str, float] = {}
    for i, name in enumerate(names):
        sel = keep & (teacher_index == i).to(keep.device)[:, None]
        if bool(sel.any()):
            out[name] = float(masked_mean(diff, sel))
    out["mean"] = float(masked_mean(diff, keep))
    return out


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean entropy (nats) of the next-token distribution over masked positions.

    Entropy collapse is the earliest sign of an RL run going degenerate. Only the masked
    rows are gathered before the softmax, which keeps the [N, V] temporary to the trained
    tokens instead of the whole padded [B, T, V] batch.
    """
    rows = logits[mask.bool()].float()
    if rows.shape[0] == 0:
        return 0.0
    logp = torch.log_softmax(rows, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return float(ent.mean())

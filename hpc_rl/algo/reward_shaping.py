"""Reward changes made before the advantages: DAPO's soft overlong punishment and the
reference-KL penalty in the reward.

Overlong (DAPO, arXiv 2503.14476, eq. 13), with L_max = generator.sampling.max_tokens and
L_cache = buffer_tokens: a response of L tokens gets
  min(0, -penalty * (L - (L_max - L_cache)) / L_cache)
so the penalty grows linearly to -penalty at L_max (DAPO's is -1 there) and on past it (no cap), as
NeMo RL's apply_reward_shaping (nemo_rl/algorithms/reward_functions.py) does for a response
(its unit-test case has a response past max_tokens).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["overlong_penalty", "kl_reward_penalty"]


def overlong_penalty(lengths: Sequence[int], max_tokens: int, buffer_tokens: int, penalty: float) -> torch.Tensor:
    """[B] float32 penalties (<= 0) for responses of `lengths` tokens."""
    if buffer_tokens <= 0 or buffer_tokens > max_tokens:
        raise ValueError(f"buffer_tokens must be in [1, max_tokens={max_tokens}], got {buffer_tokens}")
    length = torch.tensor(list(lengths), dtype=torch.float32)
    start = max_tokens - buffer_tokens
    over = (length - start).clamp(min=0)
    return -penalty * over / buffer_tokens


def kl_reward_penalty(kl_t: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """[B] coef * each sequence's summed per-token KL over its response tokens: subtracted from
    its reward (the classic RLHF reward KL, here with the estimator the config names)."""
    keep = mask.bool()
    return coef * torch.where(keep, kl_t, torch.zeros((), dtype=kl_t.dtype)).sum(dim=-1).float()

"""OPD/MOPD and GRPO advantages and losses, train/inference-mismatch corrections, metrics."""

from .aggregation import aggregate, denominator
from .kl import kl_estimate
from .reward_shaping import kl_reward_penalty, overlong_penalty
from .advantages import grpo_advantages, opd_advantages, per_token
from .losses import policy_loss, policy_loss_tokens
from .metrics import entropy_from_logits, masked_mean, reverse_kl_per_teacher, token_mult_prob_error
from .mismatch import importance_weights, mult_prob_error_per_seq, sequence_keep_mask

__all__ = [
    "opd_advantages",
    "grpo_advantages",
    "per_token",
    "policy_loss",
    "policy_loss_tokens",
    "aggregate",
    "denominator",
    "kl_estimate",
    "kl_reward_penalty",
    "overlong_penalty",
    "importance_weights",
    "mult_prob_error_per_seq",
    "sequence_keep_mask",
    "masked_mean",
    "token_mult_prob_error",
    "reverse_kl_per_teacher",
    "entropy_from_logits",
]

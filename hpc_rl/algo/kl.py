"""Per-token estimates of KL(pi || pi_ref) from the sampled tokens' log-probs.

With y_t sampled from pi and x = log pi_ref(y_t) - log pi(y_t) (NeMo RL's calculate_kl,
nemo_rl/algorithms/utils.py; Schulman, "Approximating KL Divergence"):
  k1 = -x                 unbiased, can be negative per token, high variance;
  k2 = x^2 / 2            biased, low variance; its gradient is the reverse-KL gradient;
  k3 = exp(x) - 1 - x     unbiased and >= 0 (the GRPO paper's estimator).
x is clamped first (a token the reference finds impossible would give exp(x) ~ 0 but
x ~ -1e9 through a -inf log-prob); the estimate is clamped after (one token cannot dominate).

`weights` multiply the estimate before the output clamp, as NeMo RL's (HEAD 7ea279ab):
in the loss they are exp(lp - sg[lp]), 1 in value, whose gradient adds the score-function
term kl * grad log pi (the samples come from pi, so d/dtheta E_pi[kl] has it too); where the
input clamp is active their gradient is cut, as the estimate's own is.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["ESTIMATORS", "kl_estimate"]

ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3",
                input_clamp: Optional[float] = 20.0, output_clamp: Optional[float] = 10.0,
                weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Elementwise estimate of KL(pi || pi_ref) at the sampled tokens, same shape as `logprobs`.
    The gradient flows through `logprobs` (the reference's are detached)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {ESTIMATORS}")
    x = ref_logprobs.detach().to(logprobs.dtype) - logprobs
    if input_clamp is not None:
        clamped = x.clamp(-input_clamp, input_clamp)
        if weights is not None:
            weights = torch.where(x == clamped, weights, weights.detach())
        x = clamped
    if estimator == "k1":
        kl = -x
    elif estimator == "k2":
        kl = x.square() / 2
    else:
        kl = torch.exp(x) - 1 - x
    if weights is not None:
        kl = weights * kl
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl

"""The options around the policy loss, read from `algo` once per step: the rewards the
advantages see (DAPO's overlong shaping, the reference KL in the reward), the tokens the
loss trains (DAPO's overlong filtering) and the per-token reference KL in the loss.

Kept beside the trainer role so that role reads as the step's order of work."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from hpc_rl.algo import kl_estimate, kl_reward_penalty, masked_mean, overlong_penalty


def kl_tokens(cfg, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
              weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The configured estimator and clamps of algo.ref_kl, per token (algo/kl.py)."""
    k = cfg.algo.ref_kl
    return kl_estimate(logprobs, ref_logprobs, k.estimator, k.input_clamp, k.output_clamp, weights)


def uses_reference(cfg) -> bool:
    return cfg.algo.ref_kl_coef > 0


def reference_on_trainer(cfg) -> bool:
    """trainer.lora: the trainer scores the reference (the base, adapters off) itself."""
    return uses_reference(cfg) and cfg.trainer.lora.enabled


def shaped_rewards(cfg, b) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The collection items' rewards [items] after the configured shaping, and its metrics.
    The batch's own `rewards` stay the environment's (the records show what it said)."""
    a = cfg.algo
    n = b.items
    rewards = b.rewards[:n].clone()
    out: Dict[str, float] = {}
    if a.overlong_shaping.enabled:
        o = a.overlong_shaping
        pen = overlong_penalty([len(r.response_ids) for r in b.rows[:n]], cfg.generator.sampling.max_tokens,
                               o.buffer_tokens, o.penalty)
        rewards += pen
        out["overlong_penalty_mean"] = float(pen.mean())
        out["overlong_penalized"] = int((pen < 0).sum())
    if uses_reference(cfg) and a.ref_kl.apply_to == "reward":
        mask = b.rollouts.response_mask[:n]
        pen = kl_reward_penalty(kl_tokens(cfg, b.student_logprobs[:n], b.ref_logprobs[:n]), mask, a.ref_kl_coef)
        rewards -= pen
        out["ref_kl_reward_penalty_mean"] = float(pen.mean())
    return rewards, out


def trained_tokens(cfg, b, mask: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, float]]:
    """`mask` less the samples DAPO's overlong filtering leaves out (cut at max_tokens)."""
    if not cfg.algo.loss.overlong_filtering:
        return mask, {}
    cut = torch.tensor([bool(r.truncated) for r in b.rows])
    return mask & ~cut[:, None], {"overlong_filtered": int(cut.sum())}


def kl_loss_term(cfg, lp: torch.Tensor, b, rows: torch.Tensor,
                 mask: torch.Tensor) -> Tuple[Optional[torch.Tensor], Dict[str, float]]:
    """coef * per-token KL(pi || pi_ref) to add to the per-token loss (None when the penalty is
    not in the loss), as NeMo RL's ClippedPGLossFn adds it: weighted by exp(lp - sg[lp]) (1 in
    value; its gradient is the score-function term of sampling from pi), not by the mismatch
    weights (NeMo RL's use_importance_sampling_correction weights the policy term only)."""
    a = cfg.algo
    if not uses_reference(cfg) or a.ref_kl.apply_to != "loss":
        return None, {}
    kl_t = kl_tokens(cfg, lp, b.ref_logprobs[rows].to(lp.device), weights=torch.exp(lp - lp.detach()))
    return a.ref_kl_coef * kl_t, {"ref_kl_loss": float(masked_mean(kl_t.detach().float(), mask))}


@torch.no_grad()
def ref_kl_metric(cfg, b, mask: torch.Tensor) -> Dict[str, float]:
    """The batch's KL to the reference at the weights that sampled it (the configured estimator,
    mean over trained tokens), and k1 beside it: the `ref_kl` metrics of every step."""
    if not uses_reference(cfg) or b.ref_logprobs is None or b.student_logprobs is None:
        return {}
    est = kl_tokens(cfg, b.student_logprobs, b.ref_logprobs)
    k1 = kl_estimate(b.student_logprobs, b.ref_logprobs, "k1", None, None)
    return {"ref_kl": float(masked_mean(est, mask)), "ref_kl_k1": float(masked_mean(k1, mask))}

"""The algorithm options users bring from NeMo RL, on NeMo RL's own unit-test cases.

Cases are copied from NVIDIA-NeMo/RL at 7ea279abfbeb698b092856d0dab61e7cf39bc909:
  tests/unit/algorithms/test_loss_functions.py  (calculate_kl, ClippedPGLossFn: PPO clip,
      REINFORCE, KL penalty and its gradient, GSPO)
  tests/unit/algorithms/test_reward_functions.py (DAPO overlong reward shaping)
  tests/unit/algorithms/test_grpo.py             (advantage clip, the GRPO estimator)
Their loss tests use one row of 4 tokens with token_mask [0, 1, 1, 1]: the three valid
positions are written here directly. The aggregation cases (not in NeMo RL's tests, which
use equal lengths) are computed by hand below.
"""

import math

import pytest
import torch

from hpc_rl.algo import aggregate, denominator, grpo_advantages, kl_estimate, overlong_penalty, policy_loss
from hpc_rl.algo.losses import policy_loss_tokens, sequence_log_ratio

ONES3 = torch.ones(1, 3, dtype=torch.bool)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_nemo_rl(kind):
    lp, ref = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-0.0, -15.0, -30.0]])
    expected = {"k1": [[-1.0, 14.0, 29.0]], "k2": [[0.5, 98.0, 420.5]], "k3": [[0.7183, 13.0, 28.0]]}
    clamped = {"k1": [[-1.0, 10.0, 10.0]], "k2": [[0.5, 10.0, 10.0]], "k3": [[0.7183, 10.0, 10.0]]}
    assert torch.allclose(kl_estimate(lp, ref, kind, None, None), torch.tensor(expected[kind]), rtol=1e-3)
    assert torch.allclose(kl_estimate(lp, ref, kind, 20.0, 10.0), torch.tensor(clamped[kind]), rtol=1e-3)


def test_kl_input_clamp_cuts_the_weight_gradient():
    # test_calculate_kl_detaches_importance_sampling_when_input_clamped
    lp = torch.tensor([[-3.0, -1.0]], requires_grad=True)
    w = torch.exp(lp - lp.detach())
    kl = kl_estimate(lp, torch.zeros_like(lp), "k3", 2.0, None, weights=w)
    assert torch.allclose(kl.detach(), torch.tensor([[4.389056, 0.7182818]]), atol=1e-6)
    kl.sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -1.0]]), atol=1e-6)


def test_kl_output_clamp_includes_the_weight():
    # test_calculate_kl_output_clamp_includes_importance_sampling_weight
    lp = torch.tensor([[-1.0]], requires_grad=True)
    kl = kl_estimate(lp, torch.zeros_like(lp), "k3", None, 1.0, weights=100.0 * torch.exp(lp - lp.detach()))
    assert float(kl.detach()) == 1.0
    kl.sum().backward()
    assert float(lp.grad) == 0.0


def _ppo_case():
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    prev = torch.tensor([[-1.0, -1.0, -1.0]])
    curr = torch.tensor([[-1.69315, -1.0, -0.59453]])  # ratios 0.5, 1.0, 1.5
    return adv, prev, curr


def test_ppo_clip_matches_nemo_rl():
    adv, prev, curr = _ppo_case()
    loss, m = policy_loss(curr, prev, adv, ONES3, "ppo", 0.2, 0.2)
    assert math.isclose(float(loss), -0.6333, rel_tol=1e-3)  # test_clipped_pg_loss_ppo_clipping
    assert math.isclose(m["clip_frac"], 1 / 3, rel_tol=1e-6)  # only the 1.5 token's gradient is clipped


def test_reinforce_matches_nemo_rl():
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    curr = torch.tensor([[-0.5, -1.0, -1.5]])
    loss, _ = policy_loss(curr, None, adv, ONES3, "reinforce")
    assert math.isclose(float(loss), 0.8333, rel_tol=1e-3)  # test_clipped_pg_loss_reinforce_mode


def test_kl_penalty_in_the_loss_matches_nemo_rl():
    # test_clipped_pg_loss_kl_penalty: beta 0.1, k3, advantages 0, curr [0,-1,-2], ref -1
    curr = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    ref = torch.full((1, 3), -1.0)
    actor_t, _ = policy_loss_tokens(curr, torch.zeros(1, 3), torch.zeros(1, 3), ONES3, "ppo")
    kl_t = 0.1 * kl_estimate(curr, ref, "k3", 20.0, 10.0, weights=torch.exp(curr - curr.detach()))
    assert math.isclose(float(aggregate(actor_t + kl_t, ONES3)), 0.0362, rel_tol=1e-2)


def test_kl_gradient_includes_the_sampling_term():
    # test_clipped_pg_loss_kl_gradient_includes_sampling_term (use_on_policy_kl_approximation=False):
    # grad(beta) - grad(0) = beta * (kl + (1 - exp(logr))) / n_tokens, logr = ref - curr
    curr0, prev = torch.tensor([[-1.2, -0.7]]), torch.tensor([[-1.0, -0.8]])
    ref, adv, beta, mask = torch.tensor([[-0.9, -1.1]]), torch.tensor([[0.4, -0.2]]), 0.3, torch.ones(1, 2, dtype=torch.bool)

    def grad(b):
        curr = curr0.clone().requires_grad_(True)
        loss_t, _ = policy_loss_tokens(curr, prev, adv, mask, "ppo")
        loss_t = loss_t + b * kl_estimate(curr, ref, "k3", 20.0, 10.0, weights=torch.exp(curr - curr.detach()))
        aggregate(loss_t, mask).backward()
        return curr.grad

    logr = ref - curr0
    kl = torch.exp(logr) - 1 - logr
    assert torch.allclose(grad(beta) - grad(0.0), beta * (kl + (1 - torch.exp(logr))) / 2, atol=1e-6)


def test_gspo_matches_nemo_rl():
    adv, prev, curr = _ppo_case()
    # test_clipped_pg_loss_gspo: one sequence ratio 0.9086 inside the clip
    assert math.isclose(float(torch.exp(sequence_log_ratio(curr, prev, ONES3))), 0.9086, rel_tol=1e-3)
    loss, _ = policy_loss(curr, prev, adv, ONES3, "ppo", 0.2, 0.2, ratio_level="sequence",
                          aggregation="seq-mean-token-mean")
    assert math.isclose(float(loss), -0.6057, rel_tol=1e-3)
    # test_clipped_pg_loss_gspo_batch_size_2: the second sequence's ratio 2.4697 is clipped to 1.2
    adv2, prev2 = adv.repeat(2, 1), torch.cat([prev, prev - 1.0])
    mask2 = torch.ones(2, 3, dtype=torch.bool)
    loss, m = policy_loss(curr.repeat(2, 1), prev2, adv2, mask2, "ppo", 0.2, 0.2, ratio_level="sequence",
                          aggregation="seq-mean-token-mean")
    assert math.isclose(float(loss), -0.4912, rel_tol=1e-3)
    assert m["clip_frac_high"] > 0


def test_gspo_gradient_reaches_every_token_through_the_mean():
    adv, prev, curr = _ppo_case()
    curr = curr.clone().requires_grad_(True)
    loss, _ = policy_loss(curr, prev, adv, ONES3, "ppo", 0.2, 0.2, ratio_level="sequence",
                          aggregation="seq-mean-token-mean")
    loss.backward()
    # d/dlp_t of -(1/3) sum_u A_u s, s = exp(mean(lp - prev)): -(sum A) * s / 9, the same for each token
    s = 0.9086
    assert torch.allclose(curr.grad, torch.full((1, 3), -(1 - 1 + 2) * s / 9), rtol=1e-3)


def test_aggregations_by_hand():
    # two sequences: lengths 1 and 3, per-token losses [4] and [1, 2, 3]
    loss_t = torch.tensor([[4.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    assert float(aggregate(loss_t, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(loss_t, mask, "seq-mean-token-mean")) == pytest.approx((4 + 2) / 2)
    assert float(aggregate(loss_t, mask, "seq-mean-token-sum")) == pytest.approx((4 + 6) / 2)
    # a fully masked row counts in no denominator; nan in padding stays out
    loss_t = torch.cat([loss_t, torch.full((1, 3), float("nan"))])
    mask = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])
    for mode, want in (("token-mean", 2.5), ("seq-mean-token-mean", 3.0), ("seq-mean-token-sum", 5.0)):
        assert float(aggregate(loss_t, mask, mode)) == pytest.approx(want)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_over_the_share_denominator_sum_to_the_whole(mode):
    g = torch.Generator().manual_seed(0)
    loss_t = torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    mask[2] = False
    whole = aggregate(loss_t, mask, mode)
    d = denominator(mask, mode)
    parts = sum(aggregate(loss_t[i:i + 2], mask[i:i + 2], mode, d) for i in range(0, 6, 2))
    assert float(parts) == pytest.approx(float(whole), rel=1e-6)


def test_advantage_clip_matches_nemo_rl():
    # test_clip_grpo_advantages_respects_config_bounds: [[-10, 15], [0, 5]] in (-2, 3)
    adv = torch.tensor([-10.0, 15.0, 0.0, 5.0])
    out = grpo_advantages(adv * 1.0, 2, normalize_std=False, clip=(-2.0, 3.0))
    # mean-centred per group first ([-12.5, 12.5], [-2.5, 2.5]), then clipped
    assert out.tolist() == [-2.0, 3.0, -2.0, 2.5]
    assert float(out.min()) == -2.0 and float(out.max()) == 3.0


def test_grpo_estimator_matches_nemo_rl():
    # test_grpo_advantage_estimator_zero_std (use_leave_one_out_baseline=False): rewards [2,2,1,3]
    out = grpo_advantages(torch.tensor([2.0, 2.0, 1.0, 3.0]), 2)
    assert torch.allclose(out, torch.tensor([0.0, 0.0, -1 / math.sqrt(2), 1 / math.sqrt(2)]), atol=1e-5)


def test_overlong_shaping_matches_nemo_rl():
    # test_reward_shaping_with_penalties: buffer 5, penalty 0.5, max 25 (expected length 20)
    pen = overlong_penalty([10, 22, 25, 30], 25, 5, 0.5)
    assert torch.allclose(torch.tensor([1.0, 0.8, 0.6, 0.4]) + pen, torch.tensor([1.0, 0.6, 0.1, -0.6]), atol=1e-6)
    # test_reward_shaping_preserves_unshaped_reward_overlong and test_reward_shaping_no_penalties
    assert torch.allclose(pen, torch.tensor([0.0, -0.2, -0.5, -1.0]), atol=1e-6)
    assert overlong_penalty([10, 15, 18], 25, 5, 1.0).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="buffer_tokens"):
        overlong_penalty([1], 25, 0, 1.0)

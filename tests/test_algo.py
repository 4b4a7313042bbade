"""Unit tests for hpc_rl.algo against hand-computed values (small batches written out)."""

from __future__ import annotations

import math

import pytest
import torch

from hpc_rl.algo import (
    entropy_from_logits,
    grpo_advantages,
    importance_weights,
    masked_mean,
    mult_prob_error_per_seq,
    opd_advantages,
    per_token,
    policy_loss,
    reverse_kl_per_teacher,
    sequence_keep_mask,
    token_mult_prob_error,
)

LN2, LN4 = math.log(2.0), math.log(4.0)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=0)


# --------------------------------------------------------------------------- helpers


def test_masked_mean_values_and_empty_mask():
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), 5.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    close(masked_mean(x, m), (1 + 2 + 3 + 5) / 4)  # inf/nan in padding never leak
    close(masked_mean(x, m.float(), dim=1), [1.5, 4.0])
    close(masked_mean(x, torch.zeros_like(m)), 0.0)
    close(masked_mean(x, torch.tensor([[1, 0, 0], [0, 0, 0]]), dim=1), [1.0, 0.0])


# --------------------------------------------------------------------------- OPD


def test_opd_advantages_values_clip_and_mask():
    teacher = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.2, -3.0, -1.0]])
    student = torch.tensor([[0.0, -1.5, -0.5, -0.5], [0.0, -1.2, -0.1, -9.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    adv = opd_advantages(teacher, student, mask, clip=1.0)
    # raw teacher - student: row0 [0, 0.5, -1.5, 0.0] -> clip -> [0, 0.5, -1.0, 0]
    #                        row1 [0, 1.0, -2.9, 8.0] -> clip -> [0, 1.0, -1.0, (masked) 0]
    close(adv, [[0.0, 0.5, -1.0, 0.0], [0.0, 1.0, -1.0, 0.0]])
    assert not adv.requires_grad  # stop-gradient: a constant for the loss
    # a wider clip lets the raw values through; position 0 and padding stay 0
    close(opd_advantages(teacher, student, mask, clip=5.0), [[0.0, 0.5, -1.5, 0.0], [0.0, 1.0, -2.9, 0.0]])
    with pytest.raises(ValueError):
        opd_advantages(teacher, student, mask, clip=0.0)


def test_opd_token_mean_baseline_subtracts_the_mean_of_the_trained_tokens():
    teacher = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.2, -3.0, -1.0]])
    student = torch.tensor([[0.0, -1.5, -0.5, -0.5], [0.0, -1.2, -0.1, -9.0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    # clipped at 1: trained tokens [0.5, -1.0, 0.0, 1.0, -1.0], mean -0.1
    adv = opd_advantages(teacher, student, mask, clip=1.0, baseline="token_mean")
    close(adv, [[0.0, 0.6, -0.9, 0.1], [0.0, 1.1, -0.9, 0.0]])
    assert abs(float(adv[mask].sum())) < 1e-6
    with pytest.raises(ValueError, match="baseline"):
        opd_advantages(teacher, student, mask, clip=1.0, baseline="batch")


# --------------------------------------------------------------------------- GRPO

# group 1: [1, 0, 0, 0]: mean 0.25, centred [0.75, -0.25, -0.25, -0.25],
#          unbiased var = (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5
# group 2: [3, 1, 2, 2]: mean 2, centred [1, -1, 0, 0], unbiased var = 2 / 3, std sqrt(2/3)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0])
S23 = math.sqrt(2.0 / 3.0)


def test_grpo_mean_baseline_without_std():
    adv = grpo_advantages(REWARDS, group_size=4, normalize_std=False)
    close(adv, [0.75, -0.25, -0.25, -0.25, 1.0, -1.0, 0.0, 0.0])


def test_grpo_mean_baseline_with_std():
    adv = grpo_advantages(REWARDS, group_size=4, eps=0.0)
    # group 1: centred / 0.5 ; group 2: centred / sqrt(2/3) = [1.2247, -1.2247, 0, 0]
    close(adv, [1.5, -0.5, -0.5, -0.5, 1 / S23, -1 / S23, 0.0, 0.0])


def test_grpo_leave_one_out():
    adv = grpo_advantages(REWARDS, group_size=4, leave_one_out=True, normalize_std=False)
    # group 1: 1 - mean(0,0,0) = 1 ; 0 - mean(1,0,0) = -1/3 (x3)
    # group 2: 3 - mean(1,2,2) = 4/3 ; 1 - mean(3,2,2) = -4/3 ; 2 - mean(3,1,2) = 0 (x2)
    close(adv, [1.0, -1 / 3, -1 / 3, -1 / 3, 4 / 3, -4 / 3, 0.0, 0.0])
    adv_std = grpo_advantages(REWARDS, group_size=4, leave_one_out=True, eps=0.0)
    # divided by the same group std: group 1 / 0.5, group 2 / sqrt(2/3)
    close(adv_std, [2.0, -2 / 3, -2 / 3, -2 / 3, (4 / 3) / S23, -(4 / 3) / S23, 0.0, 0.0])


def test_grpo_constant_group_is_zero_not_nan():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), group_size=2)
    # group [1, 1] has no signal; group [0, 1]: centred [-0.5, 0.5], unbiased std sqrt(0.5)
    close(adv, [0.0, 0.0, -0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)], tol=1e-4)


def test_grpo_rejects_bad_group_layout():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        grpo_advantages(torch.zeros(4), group_size=1)


def test_per_token_broadcasts_over_mask():
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    close(per_token(torch.tensor([2.0, -1.0]), mask), [[0, 2, 2, 2], [0, -1, -1, 0]])


# --------------------------------------------------------------------------- losses

# PPO case with clip_low=0.1, clip_high=0.2 (masked tokens only):
#   row0 t1: ratio 1.5, A=+1 -> min(1.5, 1.2)   = 1.2  -> loss -1.2  (clipped high)
#   row0 t2: ratio 0.5, A=-1 -> min(-0.5, -0.9) = -0.9 -> loss +0.9  (clipped low)
#   row0 t3: ratio 1.1, A=+2 -> min(2.2, 2.2)   = 2.2  -> loss -2.2
#   row1 t1: ratio 0.7, A=+1 -> min(0.7, 0.9)   = 0.7  -> loss -0.7
#   row1 t2: ratio 1.5, A=-1 -> min(-1.5, -1.2) = -1.5 -> loss +1.5
# mean over 5 tokens: (-1.2 + 0.9 - 2.2 - 0.7 + 1.5) / 5 = -0.34 ; clip fraction 2/5
# d loss / d logprob = -ratio * A / 5 where unclipped, 0 where clipped.
PPO_RATIO = torch.tensor([[1.0, 1.5, 0.5, 1.1], [1.0, 0.7, 1.5, 1.0]])
PPO_ADV = torch.tensor([[0.0, 1.0, -1.0, 2.0], [0.0, 1.0, -1.0, 0.0]])
PPO_MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)


def _ppo_inputs():
    old = torch.tensor([[0.0, -1.0, -2.0, -0.3], [0.0, -0.4, -1.0, -2.0]])
    logprobs = (old + PPO_RATIO.log()).clone()
    logprobs[1, 3] = 80.0  # padding: exp(80 - old) would overflow float32 if not masked
    return logprobs.requires_grad_(True), old


def test_ppo_asymmetric_clipping_values_and_gradient():
    logprobs, old = _ppo_inputs()
    loss, m = policy_loss(logprobs, old, PPO_ADV, PPO_MASK, kind="ppo", clip_low=0.1, clip_high=0.2)
    close(loss, -0.34)
    close(m["clip_frac"], 0.4)
    close(m["clip_frac_high"], 0.2)
    close(m["clip_frac_low"], 0.2)
    close(m["ratio_mean"], (1.5 + 0.5 + 1.1 + 0.7 + 1.5) / 5)
    assert m["num_tokens"] == 5
    loss.backward()
    close(logprobs.grad, [[0.0, 0.0, 0.0, -1.1 * 2 / 5], [0.0, -0.7 / 5, 1.5 / 5, 0.0]])
    # symmetric clip 0.2 would clip the negative token at 0.8 instead: loss differs
    loss_sym, _ = policy_loss(logprobs, old, PPO_ADV, PPO_MASK, clip_low=0.2, clip_high=0.2)
    close(loss_sym, (-1.2 + 0.8 - 2.2 - 0.7 + 1.5) / 5)


def test_ppo_backprops_only_through_logprobs():
    logprobs, old = _ppo_inputs()
    old = old.clone().requires_grad_(True)
    adv = PPO_ADV.clone().requires_grad_(True)
    weights = torch.tensor([[0.0, 2.0, 1.0, 0.5], [0.0, 1.0, 3.0, 1.0]], requires_grad=True)
    loss, _ = policy_loss(logprobs, old, adv, PPO_MASK, clip_low=0.1, clip_high=0.2, weights=weights)
    # weighted: (2 * -1.2 + 1 * 0.9 + 0.5 * -2.2 + 1 * -0.7 + 3 * 1.5) / 5 = 1.2 / 5
    close(loss, 0.24)
    loss.backward()
    assert logprobs.grad is not None
    assert old.grad is None and adv.grad is None and weights.grad is None
    # weights scale the gradient as constants
    close(logprobs.grad, [[0.0, 0.0, 0.0, -0.5 * 1.1 * 2 / 5], [0.0, -0.7 / 5, 3 * 1.5 / 5, 0.0]])


def test_reinforce_gradient_is_minus_adv_over_num_tokens():
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    adv = per_token(torch.tensor([2.0, -1.0]), mask)
    logprobs = torch.tensor([[0.0, -0.3, -1.2, -0.7], [0.0, -2.0, -0.1, float("nan")]], requires_grad=True)
    loss, m = policy_loss(logprobs, None, adv, mask, kind="reinforce")
    # loss = -(2 * (-0.3 - 1.2 - 0.7) - (-2.0 - 0.1)) / 5 = -(-4.4 + 2.1) / 5 = 0.46
    close(loss, 0.46)
    loss.backward()
    # -A * mask / num_tokens
    close(logprobs.grad, [[0.0, -0.4, -0.4, -0.4], [0.0, 0.2, 0.2, 0.0]])
    assert m["num_tokens"] == 5
    # a [B] advantage is broadcast the same way
    loss_b, _ = policy_loss(logprobs.detach(), None, torch.tensor([2.0, -1.0]), mask, kind="reinforce")
    close(loss_b, 0.46)


def test_policy_loss_rejects_unknown_kind_and_missing_old():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown policy loss kind"):
        policy_loss(lp, lp, lp, torch.ones(1, 2), kind="dpo")
    with pytest.raises(ValueError, match="needs old_logprobs"):
        policy_loss(lp, None, lp, torch.ones(1, 2), kind="ppo")


def test_policy_loss_empty_mask_is_zero():
    lp = torch.zeros(1, 3, requires_grad=True)
    loss, m = policy_loss(lp, lp.detach(), torch.ones(1, 3), torch.zeros(1, 3))
    close(loss, 0.0)
    assert m["num_tokens"] == 0


# --------------------------------------------------------------------------- mismatch

# trainer - generation log-ratios of the four masked tokens: ratios 0.5, 1.0, 3.0, 1.5
MM_GEN = torch.tensor([[0.0, -1.0, -2.0, -0.5, -0.5], [0.0, -1.0, -1.0, -1.0, -1.0]])
MM_RATIO = torch.tensor([[1.0, 0.5, 1.0, 3.0, 1.5], [1.0, 1.0, 100.0, 1.0, 1.0]])
MM_TRAIN = MM_GEN + MM_RATIO.log()
MM_MASK = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)


def test_tis_clamps_ratio():
    w = importance_weights(MM_TRAIN, MM_GEN, MM_MASK, kind="tis", min=0.8, max=2.0)
    close(w, [[0.0, 0.8, 1.0, 2.0, 1.5], [0.0, 1.0, 0.0, 0.0, 0.0]])
    assert not w.requires_grad


def test_icepop_zeroes_out_of_range_ratio():
    w = importance_weights(MM_TRAIN, MM_GEN, MM_MASK, kind="icepop", min=0.8, max=2.0)
    close(w, [[0.0, 0.0, 1.0, 0.0, 1.5], [0.0, 1.0, 0.0, 0.0, 0.0]])


def test_no_correction_is_mask():
    w = importance_weights(MM_TRAIN, MM_GEN, MM_MASK, kind="none")
    close(w, MM_MASK.float())
    with pytest.raises(ValueError):
        importance_weights(MM_TRAIN, MM_GEN, MM_MASK, kind="bogus")


def test_sequence_keep_mask_threshold():
    gen = torch.zeros(3, 4)
    train = torch.tensor([[0.0, LN2, -LN2, 9.0], [0.0, math.log(1.1), 0.0, 0.0], [0.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    # row0: mean(exp(ln2), exp(ln2)) = 2 (the unmasked 9.0 is ignored); row1: 1.1; row2: no tokens -> 1
    close(mult_prob_error_per_seq(train, gen, mask), [2.0, 1.1, 1.0])
    assert sequence_keep_mask(train, gen, mask, threshold=1.5).tolist() == [False, True, True]
    assert sequence_keep_mask(train, gen, mask, threshold=2.5).tolist() == [True, True, True]
    assert sequence_keep_mask(train, gen, mask, threshold=None).tolist() == [True, True, True]


# --------------------------------------------------------------------------- metrics


def test_token_mult_prob_error_known_delta():
    a = torch.tensor([[0.0, LN2, -LN4, 7.0]])
    b = torch.zeros(1, 4)
    mask = torch.tensor([[0, 1, 1, 0]])
    # mean(exp(ln 2), exp(ln 4)) = (2 + 4) / 2 = 3 (the unmasked delta 7 is ignored)
    assert token_mult_prob_error(a, b, mask) == pytest.approx(3.0, abs=1e-5)
    assert token_mult_prob_error(a, a, mask) == pytest.approx(1.0)


def test_reverse_kl_per_teacher_routes_samples():
    teacher = torch.zeros(3, 4)
    student = torch.tensor([[0.0, 0.2, 0.4, 9.0], [0.0, 1.0, 9.0, 9.0], [0.0, 0.6, 9.0, 9.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 0, 0]], dtype=torch.bool)
    index = torch.tensor([0, 1, 0])
    out = reverse_kl_per_teacher(student, teacher, mask, index, ["math", "code", "chat"])
    # math: rows 0 and 2 -> (0.2 + 0.4 + 0.6) / 3 = 0.4 ; code: row 1 -> 1.0 ; chat: no samples
    # mean over all 4 tokens: (0.2 + 0.4 + 1.0 + 0.6) / 4 = 0.55 (not the teacher average 0.7)
    assert set(out) == {"math", "code", "mean"}
    assert out["math"] == pytest.approx(0.4, abs=1e-6)
    assert out["code"] == pytest.approx(1.0, abs=1e-6)
    assert out["mean"] == pytest.approx(0.55, abs=1e-6)
    with pytest.raises(ValueError):
        reverse_kl_per_teacher(student, teacher, mask, torch.tensor([0, 3, 0]), ["math", "code", "chat"])


def test_entropy_uniform_is_log_v():
    V = 7
    logits = torch.zeros(2, 3, V)
    logits[1, 2, 0] = 50.0  # a peaked (entropy ~0) position, masked out
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    assert entropy_from_logits(logits, mask) == pytest.approx(math.log(V), abs=1e-5)
    # including the peaked position pulls the mean down: (3 * log 7 + ~0) / 4
    mask[1, 2] = True
    assert entropy_from_logits(logits, mask) == pytest.approx(3 * math.log(V) / 4, abs=1e-5)
    assert entropy_from_logits(logits, torch.zeros_like(mask)) == 0.0

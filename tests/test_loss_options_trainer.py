"""The NeMo RL algorithm options inside a real train step (FSDP2 over one gloo rank):
the reference KL (in the loss and in the reward), GSPO, each loss aggregation, DAPO's
overlong filtering and shaping, GRPO's advantage clip.

Each option must give the same loss and gradients whether the old log-probs come from the
separate pass or the training forward (roles/old_logprobs.py), and whatever the
micro-batch size (aggregation.py's share denominator); the advantages and metrics are
checked against the formulas (tests/test_algo_options.py checks those on NeMo RL's cases)."""

import pytest
import torch

from hpc_rl.algo import grpo_advantages, kl_estimate, masked_mean, overlong_penalty, per_token
from test_old_logprobs import GRPO, _same, _step, tiny_ckpt  # noqa: F401 (a fixture)
from gloo_ranks import run_ranks

MICRO2 = ["trainer.global_batch_size=8", "trainer.micro_batch_size=2"]
MICRO8 = ["trainer.global_batch_size=8", "trainer.micro_batch_size=8"]
REF = ["algo.ref_kl_coef=0.1", "algo.ref_kl.estimator=k3"]
GSPO = ["algo.loss.ratio_level=sequence", "algo.loss.aggregation=seq-mean-token-mean", "algo.mismatch.kind=none",
        "algo.loss.ratio_clip_low=0.05", "algo.loss.ratio_clip_high=0.05"]
SHAPING = ["generator.sampling.max_tokens=8", "algo.overlong_shaping.enabled=true",
           "algo.overlong_shaping.buffer_tokens=4", "algo.overlong_shaping.penalty=1.0",
           "algo.grpo.adv_clip_low=-1.0", "algo.grpo.adv_clip_high=1.2"]
LENGTHS = (8, 5, 8, 2, 6, 7, 3, 8)
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.25, 0.0, 1.0])  # test_old_logprobs._step's

RUNS = {
    "plain_micro2": (GRPO + MICRO2, {}),
    "ref_loss_micro2": (GRPO + MICRO2 + REF, {"ref_shift": 0.5}),
    "ref_reward": (GRPO + MICRO2 + REF + ["algo.ref_kl.apply_to=reward"], {"ref_shift": 0.5}),
    "gspo_micro2": (GRPO + MICRO2 + GSPO, {}),
    "gspo_micro8": (GRPO + MICRO8 + GSPO, {}),
    "tokensum_micro2": (GRPO + MICRO2 + ["algo.loss.aggregation=seq-mean-token-sum"], {}),
    "tokensum_micro8": (GRPO + MICRO8 + ["algo.loss.aggregation=seq-mean-token-sum"], {}),
    "filtered_micro2": (GRPO + MICRO2 + ["algo.loss.overlong_filtering=true"], {"truncated": (1, 5)}),
    "shaped": (GRPO + MICRO2 + SHAPING, {"lengths": LENGTHS}),
}


def _worker(rank, world, ckpt, out):
    torch.manual_seed(0)
    got = {}
    for name, (overrides, extra) in RUNS.items():
        got[name] = {"separate": _step(ckpt, overrides, True, **extra)}
        if name not in ("ref_reward", "shaped"):  # the reward-side options run the separate pass anyway
            got[name]["skipped"] = _step(ckpt, overrides, False, **extra)
    torch.save(got, out)


@pytest.fixture(scope="module")
def steps(tiny_ckpt, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("loss_options")
    run_ranks(_worker, 1, tmp / "store", str(tiny_ckpt), str(tmp / "out.pt"))
    return torch.load(tmp / "out.pt")


def _grads_differ(a, b, at_least=1e-4):
    return max(float((a["grads"][n] - b["grads"][n]).abs().max()) for n in a["grads"]) > at_least


@pytest.mark.parametrize("name", ["ref_loss_micro2", "gspo_micro2", "tokensum_micro2", "filtered_micro2"])
def test_each_option_gives_one_loss_on_both_old_logprob_paths(steps, name):
    _same(steps[name]["separate"], steps[name]["skipped"])


@pytest.mark.parametrize("pair", [("gspo_micro2", "gspo_micro8"), ("tokensum_micro2", "tokensum_micro8")])
def test_sequence_aggregations_accumulate_micro_batches_to_the_one_piece_gradient(steps, pair):
    a, b = steps[pair[0]]["separate"], steps[pair[1]]["separate"]
    for n, g in a["grads"].items():
        torch.testing.assert_close(b["grads"][n], g, rtol=1e-4, atol=1e-6)


def test_reference_kl_in_the_loss_changes_the_gradient_and_is_reported(steps):
    s = steps["ref_loss_micro2"]["separate"]
    assert _grads_differ(s, steps["plain_micro2"]["separate"])
    kl = kl_estimate(s["separate"], s["ref"], "k3", 20.0, 10.0)
    assert s["metrics"]["ref_kl"] == pytest.approx(float(masked_mean(kl, s["mask"])), rel=1e-5)
    assert s["metrics"]["ref_kl"] > 0.01
    # the loss's own figure: each micro-batch's mean (at the weights before the step: one step), averaged
    per_micro = [float(masked_mean(kl[i:i + 2], s["mask"][i:i + 2])) for i in range(0, 8, 2)]
    assert s["metrics"]["ref_kl_loss"] == pytest.approx(sum(per_micro) / 4, rel=1e-4)


def test_reference_kl_in_the_reward_is_subtracted_before_the_advantages(steps):
    s = steps["ref_reward"]["separate"]
    pen = 0.1 * torch.where(s["mask"], kl_estimate(s["separate"], s["ref"], "k3", 20.0, 10.0), 0.0).sum(-1)
    want = per_token(grpo_advantages(REWARDS - pen, 4), s["mask"])
    torch.testing.assert_close(s["advantages"], want, rtol=1e-5, atol=1e-6)
    assert s["metrics"]["ref_kl_reward_penalty_mean"] == pytest.approx(float(pen.mean()), rel=1e-5)
    assert s["metrics"]["old_logprobs_path"] == "separate_pass"


def test_overlong_filtering_trains_no_token_of_a_cut_sample(steps):
    s = steps["filtered_micro2"]["separate"]
    assert s["metrics"]["overlong_filtered"] == 2
    assert _grads_differ(s, steps["plain_micro2"]["separate"])


def test_overlong_shaping_and_the_advantage_clip(steps):
    s = steps["shaped"]["separate"]
    pen = overlong_penalty(LENGTHS, 8, 4, 1.0)  # lengths 8 -> -1, 7 -> -0.75, 6 -> -0.5, 5 -> -0.25
    assert pen.tolist() == [-1.0, -0.25, -1.0, 0.0, -0.5, -0.75, 0.0, -1.0]
    want = per_token(grpo_advantages(REWARDS + pen, 4, clip=(-1.0, 1.2)), s["mask"])
    torch.testing.assert_close(s["advantages"], want, rtol=1e-5, atol=1e-6)
    assert float(s["advantages"].max()) == pytest.approx(1.2) and float(s["advantages"].min()) == pytest.approx(-1.0)
    assert s["metrics"]["overlong_penalized"] == 6

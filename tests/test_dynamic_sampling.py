"""DAPO's dynamic sampling (#45): group selection and concatenation on hand-made collections,
the top-up loop and its cap, the orders it sends (lock-step and asynchronous), the config
checks, and a real tiny_dapo run whose every trained batch is full and carries a signal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch

from hpc_rl.algo import grpo_advantages
from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.validate_dynamic_sampling import check_dynamic_sampling
from hpc_rl.data.dataset import PromptIterator, PromptRecord
from hpc_rl.messaging.messages import COLLECT, REFIT, Batch
from hpc_rl.refit.vllm_engine import SampleRow, pad_rows
from hpc_rl.rl import async_rollout, dynamic_sampling
from hpc_rl.rl.batch_ops import concat, group_rewards, select_groups, signal_groups
from hpc_rl.rl.dynamic_sampling import DynamicSamplingError, LockStep, fill

N = 2  # generations per prompt in the hand-made collections


def _gathered(rewards, tag="a", version=0, lengths=None):
    """A collection as Collector.gather returns it, plus a field no code here knows of
    (`ref`: per item, like a reference model's scores) to show new fields are carried."""
    n = len(rewards)
    lengths = lengths or [1] * n
    rows = [SampleRow([1, 2], [3] * lengths[i], [-0.5] * lengths[i], False, f"{tag}{i}", version_first=version,
                      version_last=version) for i in range(n)]
    return {"records": [PromptRecord(f"{tag}p{i // N}", "add_agent", id=f"{tag}{i // N}") for i in range(n)],
            "rows": rows, "versions": [version], "rewards": [float(r) for r in rewards], "correct": [r > 0 for r in rewards],
            "teacher": {i: [-float(i)] for i in range(n)}, "reference": {i: [-2.0 * i] for i in range(n)},
            "ref": [f"{tag}ref{i}" for i in range(n)],
            "generate_busy_s": 1.5, "agentic": {}, "siblings": []}


def _cfg(prompts=2, cap=3, shaping=False, buffer=2, max_tokens=4):
    return SimpleNamespace(
        run=SimpleNamespace(seed=7, max_steps=3),
        generator=SimpleNamespace(sampling=SimpleNamespace(max_tokens=max_tokens)),
        algo=SimpleNamespace(generations_per_prompt=N, prompts_per_step=prompts,
                             dynamic_sampling=SimpleNamespace(enabled=True, max_collections=cap),
                             overlong_shaping=SimpleNamespace(enabled=shaping, buffer_tokens=buffer, penalty=1.0),
                             async_rollout=SimpleNamespace(max_trajectory_age_steps=1, in_flight_weight_updates=False)))


# ------------------------------------------------------------------------------ groups
def test_groups_of_one_reward_carry_no_signal_and_overlong_shaping_can_give_them_one():
    g = _gathered([1, 1, 0, 1, 0, 0], lengths=[1, 1, 4, 1, 2, 4])
    assert signal_groups(group_rewards(g, N)) == [1]
    # shaped over the last 2 of 4 tokens: group 2's samples (lengths 2 and 4) now differ, group 0's do not
    assert signal_groups(group_rewards(g, N, SimpleNamespace(enabled=True, buffer_tokens=2, penalty=1.0), 4)) == [1, 2]
    # every group the filter keeps has a nonzero advantage, every one it drops a zero one
    adv = grpo_advantages(torch.tensor(g["rewards"]), N).view(-1, N)
    assert [g_ for g_ in range(3) if bool((adv[g_] != 0).any())] == [1]


def test_select_keeps_whole_groups_in_order_with_every_field_renumbered():
    g = _gathered([0, 1, 1, 1, 1, 0])
    out = select_groups(g, [2, 0], N)
    assert [r.text for r in out["rows"]] == ["a4", "a5", "a0", "a1"]
    assert out["rewards"] == [1.0, 0.0, 0.0, 1.0] and out["correct"] == [True, False, False, True]
    assert out["ref"] == ["aref4", "aref5", "aref0", "aref1"]  # an unknown per-item field follows its items
    assert out["teacher"] == {0: [-4.0], 1: [-5.0], 2: [-0.0], 3: [-1.0]}  # keyed by item: renumbered
    assert out["reference"] == {0: [-8.0], 1: [-10.0], 2: [-0.0], 3: [-2.0]}  # the reference model's scores too
    assert [r.id for r in out["records"]] == ["a2", "a2", "a0", "a0"]
    assert out["versions"] == [0] and out["generate_busy_s"] == 1.5
    with pytest.raises(ValueError, match="whole groups"):
        select_groups(_gathered([0, 1, 1]), [0], N)


def test_concat_offsets_items_and_joins_the_collections_figures():
    a, b = select_groups(_gathered([0, 1, 1, 1]), [0], N), _gathered([1, 0, 0, 1], tag="b", version=3)
    out = concat([a, b])
    assert [r.text for r in out["rows"]] == ["a0", "a1", "b0", "b1", "b2", "b3"]
    assert out["rewards"] == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0] and out["ref"][2] == "bref0"
    assert out["teacher"] == {0: [-0.0], 1: [-1.0], 2: [-0.0], 3: [-1.0], 4: [-2.0], 5: [-3.0]}
    assert out["reference"][5] == [-6.0]
    assert out["versions"] == [0, 3] and out["generate_busy_s"] == 3.0
    # the step's Batch is built from it as from any collection: re-padded to the widest row
    batch = Batch(out["records"], out["rows"], pad_rows(out["rows"], 0), out["versions"])
    assert tuple(batch.rollouts.input_ids.shape) == (6, 3) and batch.items == 6


# ------------------------------------------------------------------------------- the loop
def test_fill_tops_up_until_the_step_is_full_and_drops_the_last_collections_surplus():
    more = {1: _gathered([1, 1, 0, 1, 0, 0], tag="b"), 2: _gathered([1, 0, 0, 1, 1, 0, 1, 1], tag="c")}
    asked = []
    out, stats = fill(_gathered([0, 0, 1, 0]), 5, _cfg(prompts=3, cap=3), lambda c: asked.append(c) or more[c])
    assert asked == [1, 2]
    # a1 group, b's group 1, then c's first group; c's next two signal groups are surplus
    assert [r.text for r in out["rows"]] == ["a2", "a3", "b2", "b3", "c0", "c1"]
    assert stats == {"dynamic_sampling/collections": 3, "dynamic_sampling/groups_sampled": 2 + 3 + 4,
                     "dynamic_sampling/groups_dropped": 1 + 2 + 1, "dynamic_sampling/groups_surplus": 2,
                     "dynamic_sampling/groups_kept": 3, "dynamic_sampling/reward_mean_sampled": 9 / 18}
    for rs in group_rewards(out, N):
        assert max(rs) != min(rs)


def test_a_full_first_collection_needs_no_top_up():
    out, stats = fill(_gathered([0, 1, 1, 0, 1, 0]), 1, _cfg(prompts=2), lambda c: pytest.fail("no top-up wanted"))
    assert stats["dynamic_sampling/collections"] == 1 and stats["dynamic_sampling/groups_surplus"] == 1
    assert len(out["rows"]) == 2 * N


def test_the_cap_fails_the_step_naming_the_key_and_the_fixes():
    with pytest.raises(DynamicSamplingError) as info:
        fill(_gathered([1, 1, 0, 1]), 4, _cfg(prompts=2, cap=2), lambda c: _gathered([1, 1, 0, 0], tag="b"))
    text = str(info.value)
    assert "step 4" in text and "1 of algo.prompts_per_step=2" in text
    assert "algo.dynamic_sampling.max_collections=2" in text and "raise algo.dynamic_sampling.max_collections" in text
    assert "{0: 1, 1: 2}" in text  # the dropped groups by their one reward: too hard or too easy
    assert "algo.generations_per_prompt" in text and "data of another difficulty" in text


# ------------------------------------------------------------ orders: lock-step and async
class FakeCollector:
    """The driver's side of Collector: orders are recorded; each collection's rewards come
    from `script` (one list per collection, in order); samples carry the engine's version."""

    def __init__(self, script, pad_id=0):
        self.script, self.orders, self.is_driver, self.version = list(script), [], True, 0
        self.routes, self.group = SimpleNamespace(driver=0), None
        self.ctx = SimpleNamespace(cfg=None)

    def order(self, kind, step, records, **f):
        self.orders.append((kind, step, [r.id for r in records], dict(f.get("seeds", {})), f.get("refit_after")))

    def gather(self, records, score_env, score_teachers):
        rewards = self.script.pop(0)
        assert len(rewards) == len(records)
        g = _gathered(rewards, tag=f"{len(self.orders)}-", version=self.version)
        g["records"] = records
        return g

    def batch_of(self, g, trains_from=None):
        self.trains_from = trains_from
        b = Batch(g["records"], g["rows"], pad_rows(g["rows"], 0), g["versions"])
        b.rewards = torch.tensor(g["rewards"])
        return b


@pytest.fixture
def local_share(monkeypatch):
    """One trainer rank: a share is the driver's value."""
    for mod in (dynamic_sampling, async_rollout):
        monkeypatch.setattr(mod.exchange, "share", lambda obj, src, group: obj)


def _data(n=8):
    return [PromptRecord(f"q{i}", "add_agent", id=str(i)) for i in range(n)]


def test_lock_step_orders_top_ups_without_a_refit_then_the_steps_refit(local_share):
    it = PromptIterator(_data(), 2, seed=1, shuffle=False)
    col = FakeCollector([[1, 1, 0, 1], [0, 0, 1, 1], [1, 0, 0, 0]])
    col.version = 2  # the engines hold the weights of step 2, which step 3 trains from
    batch = LockStep(_cfg(prompts=2, cap=3), col, it, None, 1, False).next_batch(3, None)
    kinds = [(k, s, refit) for k, s, _, _, refit in col.orders]
    # three collections of step 3, none followed by a refit, then the refit the loop sends after training
    assert kinds == [(COLLECT, 3, None)] * 3 + [(REFIT, 3, None)]
    # each collection drew the iterator's next prompts (consumed: a checkpoint continues after them)
    assert [ids for _, _, ids, _, _ in col.orders[:3]] == [["0", "0", "1", "1"], ["2", "2", "3", "3"], ["4", "4", "5", "5"]]
    assert it.state_dict()["position"] == 6
    seeds = [set(s.values()) for _, _, _, s, _ in col.orders[:3]]
    assert not (seeds[0] & seeds[1]) and not (seeds[1] & seeds[2]) and not (seeds[0] & seeds[2])
    assert [x.id for x in batch.records] == ["1", "1", "4", "4"] and len(batch.rows) == 4
    assert batch.info["dynamic_sampling/collections"] == 3 and batch.info["dynamic_sampling/groups_dropped"] == 4
    assert col.trains_from == 2  # the log-prob pass may be skipped as for one collection of those weights
    # a stop draws no prompt and orders nothing
    assert LockStep(_cfg(), col, it, None, 1, False).next_batch(4, "USR1") == "USR1"
    assert it.state_dict()["position"] == 6 and len(col.orders) == 4


def test_async_tops_up_before_ordering_the_next_step_with_fresh_samples(local_share):
    """AsyncRollouts with dynamic sampling: step 1 is ordered, gathered, topped up by a fresh
    collection of the current weights, and only then is step 2 ordered (with its refit)."""
    cfg = _cfg(prompts=2, cap=3)
    cfg.run.max_steps = 2
    cfg.algo.async_rollout = SimpleNamespace(enabled=True, max_trajectory_age_steps=1, in_flight_weight_updates=False)
    col = FakeCollector([[1, 1, 0, 1], [0, 1, 1, 1], [0, 1, 0, 1]])
    refits = []
    trainer = SimpleNamespace(refit=lambda: refits.append(len(col.orders)) or 0.0)
    ctx = SimpleNamespace(cfg=cfg, set_phase=lambda *a: None, store=None)
    it = PromptIterator(_data(), 2, seed=1, shuffle=False)
    pipe = async_rollout.AsyncRollouts(ctx, col, trainer, None, it, 1, False)
    batch = pipe.next_batch(1, None)
    assert [(k, s, refit) for k, s, _, _, refit in col.orders] == [(COLLECT, 1, None), (COLLECT, 1, None), (COLLECT, 2, 1)]
    assert [x.id for x in batch.records] == ["1", "1", "2", "2"]
    assert batch.info["dynamic_sampling/collections"] == 2 and batch.info["async"]["buffer_depth"] == 1
    assert refits == []  # step 1's first order asked for none; step 2's follows its gather
    assert pipe.next_batch(2, None).info["dynamic_sampling/collections"] == 1  # [0,1,0,1]: both groups carry a signal
    assert refits == [3]


# ------------------------------------------------------------------------------ config
def _violations(*overrides, mutate=None):
    cfg = load_config(["+recipe=tiny_dapo", *overrides])
    if mutate:
        mutate(cfg)
    out = []
    check_dynamic_sampling(out, cfg)
    return out


def test_config_checks_name_the_key_and_the_fix():
    assert _violations() == []
    assert _violations("algo.dynamic_sampling.enabled=false", "algo.dynamic_sampling.max_collections=2") == []
    (v,) = _violations(mutate=lambda c: setattr(c.algo.dynamic_sampling, "max_collections", 0))
    assert v.key == "algo.dynamic_sampling.max_collections" and "at least 1" in v.problem
    with pytest.raises(ConfigError, match="algo.dynamic_sampling.max_collections"):  # validation runs it on every load
        load_config(["+recipe=tiny_dapo", "algo.dynamic_sampling.max_collections=0"])
    (v,) = _violations(mutate=lambda c: setattr(c.algo, "name", "mopd"))
    assert v.key == "algo.dynamic_sampling.enabled" and "algo.name=grpo" in v.fix
    (v,) = _violations(mutate=lambda c: setattr(c.algo, "generations_per_prompt", 1))
    assert "every group would be dropped" in v.problem and "generations_per_prompt >= 2" in v.fix
    (v,) = _violations(mutate=lambda c: setattr(c.env.agentic, "environment", "calculator"))
    assert "multi-turn episodes" in v.problem and "sibling samples" in v.problem


# --------------------------------------------------------------------------- a real run
SMALL = ["run.max_steps=4", "algo.prompts_per_step=16", "trainer.global_batch_size=128", "data.samples_per_task=32",
         "data.eval_prompts_per_task=0", "checkpoint.every_steps=2"]


def _launch(run: Path, *args):
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+recipe=tiny_dapo", *SMALL, *args, f"run.dir={run}"],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def check_every_trained_batch(run: Path, rows, prompts=16, n=8):
    """Every step trained prompts x n rows, every group of which holds differing rewards
    (after the overlong shaping the run applies), and a nonzero advantage."""
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert r["samples"] == prompts * n and r["dynamic_sampling/groups_kept"] == prompts
        assert r["dynamic_sampling/groups_sampled"] == r["dynamic_sampling/collections"] * prompts
    with h5py.File(run / "rollouts.h5", "r") as f:
        for r in steps:
            g = f[f"step_{r['step']:06d}"]
            rewards = g["rewards"][:].reshape(prompts, n)
            ids = [x.decode() if isinstance(x, bytes) else x for x in g["item_ids"][:]]
            assert rewards.shape == (prompts, n)
            assert all(len(set(ids[k * n:(k + 1) * n])) == 1 for k in range(prompts))  # whole groups of one prompt
            adv = g["advantages"][:]
            assert (np.abs(adv).sum(axis=1).reshape(prompts, n).sum(axis=1) > 0).all()  # no zero-advantage group
    return steps


@pytest.fixture(scope="module")
def dapo_run(tmp_path_factory):
    """One uninterrupted tiny_dapo run: its records, and the reference of the resume below."""
    run = tmp_path_factory.mktemp("dapo") / "run"
    return run, _launch(run)


@pytest.mark.slow
def test_tiny_dapo_trains_full_batches_of_groups_that_carry_a_signal(dapo_run):
    steps = check_every_trained_batch(*dapo_run)
    assert any(r["dynamic_sampling/collections"] > 1 for r in steps)  # the tiny student leaves some groups uniform
    # every collection of a step was sampled by the weights it trains from, in one optimizer step:
    # the training forward gives the old log-probs, as for one collection (roles/old_logprobs.py)
    assert all(r["old_logprobs_path"] == "training_forward" for r in steps)


@pytest.mark.slow
def test_a_resume_draws_exactly_the_prompts_of_the_uninterrupted_run(dapo_run, tmp_path):
    """trainer:0 dies in step 3's train phase (after step 3's top-ups drew their prompts); the
    rerun resumes from step 2's checkpoint. Steps 3 and 4 must train the very samples of the
    uninterrupted run: the saved iterator had consumed every top-up's prompts of steps 1-2,
    and nothing of step 3."""
    ref, _ = dapo_run
    run = tmp_path / "run"
    first = subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+recipe=tiny_dapo", *SMALL, f"run.dir={run}",
                            "ft.inject_failure=trainer:0:kill@train3"], capture_output=True, text=True, timeout=900)
    assert first.returncode != 0
    check_every_trained_batch(run, _launch(run))
    with h5py.File(run / "rollouts.h5", "r") as got, h5py.File(ref / "rollouts.h5", "r") as want:
        for s in range(1, 5):
            name = f"step_{s:06d}"
            assert np.array_equal(got[name]["input_ids"][:], want[name]["input_ids"][:]), name
    summary = [json.loads((d / "summary.json").read_text())["final_weights_sha256"] for d in (run, ref)]
    assert summary[0] == summary[1]


@pytest.mark.slow
def test_tiny_dapo_with_async_rollouts(tmp_path):
    run = tmp_path / "run"
    steps = check_every_trained_batch(run, _launch(run, "algo.async_rollout.enabled=true"))
    for r in steps:
        assert max(int(a) for a in r["versions"]["age"]) <= 1  # within max_trajectory_age_steps

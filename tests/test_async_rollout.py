"""Asynchronous rollouts (#15): the age bound on gathered collections, and real runs with
`algo.async_rollout.enabled=true` (FSDP2 trainer, vLLM generator, env, teachers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from hpc_rl.data.dataset import PromptRecord
from hpc_rl.refit.vllm_engine import SampleRow
from hpc_rl.rl.staleness import age_histogram, drop_stale
from slow_train_step import SLOW_TRAIN_STEP, check_slow_train_step_was_waited_for


def _gathered(first_versions, group_size=2):
    n = len(first_versions)
    rows = [SampleRow([1, 2], [3 + i], [-0.5], False, f"s{i}", version_first=v, version_last=v)
            for i, v in enumerate(first_versions)]
    records = [PromptRecord(f"p{i // group_size}", "add_agent") for i in range(n)]
    return {"records": records, "rows": rows, "versions": sorted(set(first_versions)), "rewards": [float(i) for i in range(n)],
            "correct": [i % 2 == 0 for i in range(n)], "teacher": {i: [-float(i)] for i in range(n)}, "generate_busy_s": 0.0}


def test_a_sample_older_than_the_bound_leaves_the_batch_with_its_group():
    # policy version 5 (training step 6), bound 1: versions 4 and 5 are fresh, 3 is two steps old
    g = _gathered([4, 4, 3, 5, 5, 5], group_size=2)
    out, dropped = drop_stale(g, policy_version=5, bound=1, group_size=2)
    assert dropped == 2  # sample 2 is stale, and its group partner 3 goes with it
    assert [r.text for r in out["rows"]] == ["s0", "s1", "s4", "s5"]
    assert all(5 - r.version_first <= 1 for r in out["rows"])  # nothing older than the bound remains
    assert out["rewards"] == [0.0, 1.0, 4.0, 5.0] and out["correct"] == [True, False, True, False]
    # teacher scores follow their samples to the new positions
    assert out["teacher"] == {0: [-0.0], 1: [-1.0], 2: [-4.0], 3: [-5.0]}
    assert len(out["records"]) == 4


def test_fresh_collections_pass_untouched_and_an_all_stale_one_is_an_error():
    g = _gathered([4, 4, 5, 5])
    assert drop_stale(g, policy_version=5, bound=1, group_size=2) == (g, 0)
    with pytest.raises(RuntimeError, match="max_trajectory_age_steps=0"):
        drop_stale(g, policy_version=6, bound=0, group_size=2)
    assert age_histogram([4, 4, 5, 3], 5) == {"0": 1, "1": 2, "2": 1}


def test_the_live_view_shows_the_pipeline_of_the_last_step():
    from hpc_rl.observe.live import metrics_section

    steps = [{"kind": "step", "step": s, "async": {"buffer_depth": 1, "stale_dropped": s - 1}, "versions": {"age": {"1": 64}},
              "timing": {"step_s": 2.0, "wait_rows_s": 0.3, "generate_busy_s": 1.5}} for s in (1, 2, 3)]
    text = "\n".join(metrics_section(steps, 5))
    assert "async rollouts: buffer depth 1, stale dropped 3 in all, sample ages {'1': 64}" in text
    assert "trainer idle 15%" in text and "generator idle 25%" in text
    assert "async rollouts" not in "\n".join(metrics_section([{"kind": "step", "step": 1, "timing": {"step_s": 1.0}}], 5))


SMALL = ["run.max_steps=4", "algo.prompts_per_step=16", "trainer.global_batch_size=32", "data.samples_per_task=32",
         "data.eval_prompts_per_task=0", "checkpoint.every_steps=2", "algo.async_rollout.enabled=true"]


def _launch(run: Path, *args, env=None):
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", *args, f"run.dir={run}"], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_async_grpo_trains_one_step_behind_and_never_beyond_the_bound(tmp_path):
    run = tmp_path / "run"
    # with a reference model (algo.ref_kl_coef): its group scores the gathered collections too
    rows = _launch(run, "+recipe=tiny_grpo", *SMALL, *SLOW_TRAIN_STEP, "algo.ref_kl_coef=0.05")
    check_slow_train_step_was_waited_for(run, phase="wait_send")
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # the reference is the starting student in its precision: step 1's samples and weights are
    # the start's, so their KL is 0 to rounding; later the trained weights move away from it
    assert abs(steps[0]["ref_kl"]) < 1e-5 and all(r["ref_kl"] > 1e-6 for r in steps[1:]), [r["ref_kl"] for r in steps]
    with h5py.File(run / "rollouts.h5", "r") as f:
        for s in range(1, 5):
            g = f[f"step_{s:06d}"]
            first, last = g["weight_version_first"][:], g["weight_version_last"][:]
            # step s trains on samples of the weights of step s-2 (generated while s-1 trained);
            # the first step's come from the initial weights
            assert (first == max(s - 2, 0)).all() and (last == first).all(), (s, first)
            assert ((s - 1) - first <= 1).all()  # the age bound (1) held for every trained sample
    for r in steps:
        # one step sampling ahead while this one trains, none after the last
        assert r["async"]["stale_dropped"] == 0 and r["async"]["buffer_depth"] == (r["step"] < 4)
        assert r["versions"]["age"] == ({"0": 128} if r["step"] == 1 else {"1": 128})
        assert {"wait_rows_s", "generate_busy_s", "train_s", "refit_s", "step_s"} <= set(r["timing"])
    assert (run / "FINISHED").exists()
    # every sample is one version old after the first step: no step measures the engine
    # against the trainer on the same weights, and the policy's change is reported apart
    assert "token_mult_prob_error" in steps[0] and all("token_mult_prob_error" not in r for r in steps[1:])
    assert all(r["policy_change_mult_prob_error"] > 1.0 for r in steps[1:])


@pytest.mark.slow
def test_in_flight_weight_updates_land_mid_generation_within_the_bound(tmp_path):
    # 128 samples per step of at least 24 tokens (the tiny student ends its answers after
    # about 3) through 4 engine slots: sampling a step takes some 800 scheduler steps (about
    # 3 s) and outlasts the trainer's step (about 0.3 s), so each step's weights land while the
    # next one samples. The roles are pinned to a core each, as on separate nodes: unpinned,
    # the trainer's threads and vLLM's busy engine loop share both cores and the trainer's
    # step stretched past the sampling (3-5 s of log-probs measured).
    run = tmp_path / "run"
    rows = _launch(run, "+recipe=tiny_grpo", *SMALL, *SLOW_TRAIN_STEP, "algo.async_rollout.in_flight_weight_updates=true",
                   "generator.max_num_seqs=4", "generator.sampling.min_tokens=24", "generator.sampling.max_tokens=32",
                   env=dict(os.environ, HPC_RL_CPU_AFFINITY="trainer=0;generator=1;env=1"))
    check_slow_train_step_was_waited_for(run)  # step 3 sampled faster than step 2 trained: it waited
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    straddled = 0
    with h5py.File(run / "rollouts.h5", "r") as f:
        for s in range(1, 5):
            g = f[f"step_{s:06d}"]
            first, last = g["weight_version_first"][:], g["weight_version_last"][:]
            assert ((s - 1) - first <= 1).all(), (s, first)  # the age bound (1), from the oldest version seen
            assert (last >= first).all() and (last <= max(s - 1, 0)).all(), (s, first, last)
            straddled += int((last != first).sum())
    assert straddled > 0, "no trained sample saw two weight versions: no refit landed mid-generation"
    assert sum(r["versions"]["changed_mid_sample"] for r in steps) == straddled
    assert all(r["async"]["stale_dropped"] == 0 for r in steps)
    assert (run / "FINISHED").exists()

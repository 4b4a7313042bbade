"""The chaos drills with asynchronous rollouts on (#15), on the local Slurm cluster: USR1
before the time limit, then a killed generator, in one job. The run must finish with the weights of the
uninterrupted async run, every step's samples exactly those of that run (nothing lost,
nothing sampled twice) and no sample trained beyond the age bound. Issue 29's neighbour
attacks the attempt after the kill (the killed-generator drill of test_chaos_slurm, folded
in here: one job fewer)."""

from __future__ import annotations

import threading

import h5py
import numpy as np
import pytest

import neighbour
from hpc_rl.slurm import chaos

RUN = ["+recipe=tiny_grpo", "cluster=local_slurm", "run.max_steps=6", "algo.prompts_per_step=8",
       "algo.generations_per_prompt=2", "trainer.global_batch_size=16", "data.samples_per_task=16",
       "data.eval_prompts_per_task=0", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
       "launcher.slurm.signal_grace_s=60", "algo.async_rollout.enabled=true"]


def _rollouts(run) -> dict:
    with h5py.File(run / "rollouts.h5", "r") as f:
        return {name: (f[name]["input_ids"][:], f[name]["weight_version_first"][:]) for name in f}


def _same_samples_within_the_bound(run, reference) -> None:
    got, want = _rollouts(run), _rollouts(reference)
    assert sorted(got) == sorted(want) == [f"step_{s:06d}" for s in range(1, 7)]
    for name, (ids, first) in got.items():
        step = int(name[5:])
        assert np.array_equal(ids, want[name][0]), f"{name}: other samples than the uninterrupted run"
        assert np.array_equal(first, want[name][1]) and ((step - 1) - first <= 1).all(), (name, first)


@pytest.fixture(scope="module")
def reference(local_slurm, tmp_path_factory):
    run = tmp_path_factory.mktemp("async_ref") / "run"
    res = chaos.uninterrupted(run, RUN)
    assert res.finished, res
    return run, res


@pytest.mark.slurm
@pytest.mark.slow
def test_usr1_then_a_killed_generator_with_async_rollouts_resume_and_match(local_slurm, reference, tmp_path):
    """Two drills in one job (chaos.usr1_then): USR1 on attempt 0, the generator killed on
    attempt 1."""
    ref_run, ref = reference
    run = tmp_path / "run"
    # Issue 29's attack, on the weights: a neighbour without the job's secret attacks attempt
    # 2 (the requeue after the kill) as soon as its store listens: a file-creating pickle
    # under the readiness key of every refit, forged abort verdicts, forged rank records
    # (tests/neighbour.py). The attempt must finish with the reference's weights, the
    # rejections counted.
    marker, forged = tmp_path / "pwned", {}

    def neighbour_attacks():
        try:
            forged.update(neighbour.attack(run, neighbour.Submitted(run), marker, world=3, refit_world=2, refits=6,
                                           restart=2))
        except AssertionError as exc:
            forged["error"] = str(exc)

    attacker = threading.Thread(target=neighbour_attacks, daemon=True)
    attacker.start()
    # SIGKILL of the generator on attempt 1 when step 6's order reaches it (sent during step 5)
    res = chaos.usr1_then(run, RUN, after_steps=2, inject="generator:0:kill@6")
    attacker.join(timeout=120)
    assert res.finished, res
    # USR1: stopped after step 3 with step 4 sampled ahead: the buffer held it through the
    # requeue, attempt 1 resumed at step 3 with nothing recomputed; the kill: attempt 2
    # recomputes from the step-4 checkpoint
    assert res.events["checkpoint_saved"] and res.events["stopped_after_step"] == 3
    assert [(r["restart"], r["resumed_from_step"], r["steps_recomputed"]) for r in res.restarts][0] == (1, 3, 0)
    assert [(r["restart"], r["resumed_from_step"]) for r in res.restarts][1:] == [(2, 4)]
    assert res.summary["final_weights_sha256"] == ref.summary["final_weights_sha256"]
    _same_samples_within_the_bound(run, ref_run)
    assert all((run / "logs" / f"generator.{k}.out").exists() for k in (0, 1, 2))  # one log per restart
    assert "error" not in forged and len(forged["ready_planted"]) >= 4 and not marker.exists(), forged
    kinds = res.summary["auth_rejected_by_kind"]
    # every rank of the attempt read the forged verdict; the generator read forged readiness
    assert kinds.get("hb/*/abort", 0) >= 3 and kinds.get("refit/*/ready/*/*", 0) >= 1, res.summary
    assert res.summary["restarts"] == 2  # the forged verdict caused no third attempt

"""Chaos on the local Slurm cluster: a real GRPO run (FSDP2 trainer, vLLM generator, env)
is interrupted (USR1 before the time limit, a killed generator, `scontrol requeue` from
outside) and must finish on its own. A Slurm job whose retry budget runs out must fail
saying so: test_pipeline_slurm's teacher stage is that drill (issue #30: one launch fewer)."""

from __future__ import annotations

import threading

import pytest

import neighbour
from hpc_rl.slurm import chaos

# 6 steps of 16 samples, a checkpoint every 2 steps, no evaluation: small but complete.
RUN = ["+recipe=tiny_grpo", "cluster=local_slurm", "run.max_steps=6", "algo.prompts_per_step=8",
       "algo.generations_per_prompt=2", "trainer.global_batch_size=16", "data.samples_per_task=16",
       "data.eval_prompts_per_task=0", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
       "launcher.slurm.signal_grace_s=60"]


def _resumes(res: chaos.DrillResult) -> list:
    """(restart, step it resumed from, steps computed twice) for each resume."""
    return [(r["restart"], r["resumed_from_step"], r["steps_recomputed"]) for r in res.restarts]


@pytest.fixture(scope="module")
def reference(local_slurm, tmp_path_factory):
    """The same run without interruption: its final weights are what every drill must reach."""
    res = chaos.uninterrupted(tmp_path_factory.mktemp("ref") / "run", RUN)
    assert res.finished, res
    assert len(res.summary["final_weights_sha256"]) == 64, res.summary  # the drills compare against it
    return res


@pytest.mark.slurm
@pytest.mark.slow
def test_usr1_then_an_external_requeue_each_resume_where_they_should_and_match_the_uninterrupted_weights(
        local_slurm, reference, tmp_path):
    """Two drills in one job (chaos.usr1_then): USR1 on attempt 0, `scontrol requeue` from
    outside on attempt 1."""
    run = tmp_path / "run"
    res = chaos.usr1_then(run, RUN, after_steps=2, requeue_after=5)
    assert res.finished, res
    # USR1: the signal lands inside step 3 (the drill stalls it): the ranks finish it and save
    # it, though step 3 is no periodic checkpoint (every 2), then stop; attempt 1 resumes
    # exactly there, no step computed twice
    assert res.events["checkpoint_saved"] and res.events["stopped_after_step"] == 3
    # the requeue lands inside step 6 (stalled) on attempt 1: attempt 2 resumes from the
    # step-4 checkpoint and recomputes step 5 (step 6 never finished)
    assert res.events["requeued_after_steps"] == 5
    assert _resumes(res) == [(1, res.events["stopped_after_step"], 0), (2, 4, 1)]
    assert res.summary["restarts"] == 2 and res.summary["steps"] == 6
    assert res.summary["final_weights_sha256"] == reference.summary["final_weights_sha256"]
    assert all((run / "logs" / f"trainer.{k}.out").exists() for k in (1, 2))  # logs carry the restart count


@pytest.mark.slurm
@pytest.mark.slow
def test_killed_generator_requeues_recomputes_the_lost_step_and_matches(local_slurm, reference, tmp_path):
    run = tmp_path / "run"
    t0 = chaos.time.monotonic()
    # SIGKILL of the generator at the start of step 4: step 3 (after the step-2 checkpoint)
    # is lost and recomputed
    job = chaos.launch(run, [*RUN, "ft.inject_failure=generator:0:kill@4"])
    # Issue 29's attack, on the weights: a neighbour without the job's secret attacks the
    # second attempt (the requeue after the kill) as soon as its store listens: a
    # file-creating pickle under the readiness key of every refit, forged abort verdicts
    # (tests/neighbour.py; the het job in tests/test_rl_loop.py also forges rank records).
    # The attempt must finish with the undisturbed reference's weights, the rejections counted.
    marker, forged = tmp_path / "pwned", {}

    def neighbour_attacks():
        try:
            forged.update(neighbour.attack(run, neighbour.Submitted(run), marker, world=3, refit_world=2, refits=6,
                                           restart=1))
        except AssertionError as exc:
            forged["error"] = str(exc)

    attacker = threading.Thread(target=neighbour_attacks, daemon=True)
    attacker.start()
    res = chaos.result(run, job, chaos.follow(run, job), t0)  # follow releases the requeue hold
    attacker.join(timeout=120)
    assert res.finished, res
    assert _resumes(res) == [(1, 2, 1)]
    assert all((run / "logs" / f"generator.{k}.out").exists() for k in (0, 1))  # one log per restart
    assert res.summary["final_weights_sha256"] == reference.summary["final_weights_sha256"]
    assert "error" not in forged and len(forged["ready_planted"]) >= 4 and not marker.exists(), forged
    kinds = res.summary["auth_rejected_by_kind"]
    # every rank of the attempt read the forged verdict; the generator read forged readiness
    assert kinds.get("hb/*/abort", 0) >= 3 and kinds.get("refit/*/ready/*/*", 0) >= 1, res.summary
    assert res.summary["restarts"] == 1  # the forged verdict caused no second requeue

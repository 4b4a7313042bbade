"""Chaos on the local Slurm cluster: a real GRPO run (FSDP2 trainer, vLLM generator, env)
is interrupted (USR1 before the time limit, then `scontrol requeue` from outside) and must
finish on its own. Drills that share other tests' jobs (issue #30: a drill's time is mostly
its job's start-up):
- a killed generator, with a neighbour attacking the attempt after it: test_async_chaos;
- a Slurm job whose retry budget runs out, failing and saying so: test_pipeline_slurm's
  teacher stage."""

from __future__ import annotations

import pytest

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

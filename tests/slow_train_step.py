"""A train step that outlasts the refit deadline (issue 31), for launches the suite already
makes: trainer:0 sleeps 20 s inside its step-2 train phase while the generator already
waits for step 2's weights, under a deadline of 5 s. The deadline counts from the moment
both sides are ready to transfer, so the run goes on."""

import json
from pathlib import Path

SLOW_TRAIN_STEP = ["refit.timeout_s=5", "ft.inject_failure=trainer:0:stall20@train2"]


def check_slow_train_step_was_waited_for(run: Path, phase: str = "wait_refit") -> None:
    """The 20 s stall of SLOW_TRAIN_STEP happened and the generator spent it in `phase` of
    the step it was sampling (step 2 in lock-step, step 3 ahead of the trainer):
    - wait_refit: it had entered the refit and waited for the trainer to be ready, far past
      refit.timeout_s=5 (lock-step, and in-flight updates once sampling ended first);
    - wait_send: asynchronous rollouts without in-flight updates: its rows wait for the
      driver's gather, and the refit follows that gather, so the refit never waits on a train
      step there."""
    assert "trainer:0 at step train2 stalls for 20s" in (run / "logs" / "trainer.0.out").read_text()
    steps = [json.loads(x) for x in (run / "timing" / "generator.0.0.jsonl").read_text().splitlines()]
    waits = {s["step"]: s["phases"].get(phase, 0.0) for s in steps}
    # The claim: a wait longer than the refit deadline (5 s) did not fail the run. How much of
    # the 20 s stall the generator spends waiting depends on how long its own sampling took
    # first (14.6 s measured here under load): the bound is the deadline, not the stall.
    assert max(waits.values()) > 5.0, (phase, waits)

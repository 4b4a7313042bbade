"""Launches that several test modules read (issue 30: share launches, drop no check).

One local tiny_mopd run serves tests/test_rl_loop.py (its steps, rollouts, checkpoints and
the slow-train-step refit of tests/slow_train_step.py) and tests/test_observe.py (what every
logger wrote; every file grepped for the planted logger credentials). The session-scoped
fixture `tiny_mopd_three_steps` in tests/conftest.py runs it once.
"""

import os
import subprocess
import sys
from pathlib import Path

from slow_train_step import SLOW_TRAIN_STEP

TINY_MOPD_SMALL = ["algo.prompts_per_step=32", "trainer.global_batch_size=32", "data.samples_per_task=32",
                   "data.eval_prompts_per_task=8"]
# The shared run trains and scores packed (issue 44): several samples per row in the student's
# train step and log-prob pass and in the teachers' scoring, micro-batches by a token budget
# smaller than the batch, so a step runs several packed micro-batches.
PACKED = ["trainer.packing=true", "trainer.micro_batch_size=1", "trainer.micro_batch_tokens=256",
          "trainer.logprob_batch_tokens=256"]
EVERY_LOGGER = "logger=[jsonl,tensorboard,wandb,mlflow]"
# Planted where W&B and MLflow look for credentials; none may reach a file of the run.
LOGGER_SECRETS = {
    "WANDB_API_KEY": "hpcrlsecret0wandb0" + "7" * 22,  # W&B keys are 40 characters
    "MLFLOW_TRACKING_TOKEN": "hpcrlsecret1mlflowtoken",
    "MLFLOW_TRACKING_PASSWORD": "hpcrlsecret2mlflowpassword",
}


def launch_tiny_mopd_three_steps(run: Path):
    """`+recipe=tiny_mopd` for 3 steps, locally, packed: a checkpoint every 2 steps, every experiment
    logger on, logger credentials planted in its environment, and trainer:0 stalling 20 s
    inside step 2's train phase under refit.timeout_s=5. Returns (run_dir, CompletedProcess)."""
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+recipe=tiny_mopd", "run.max_steps=3", f"run.dir={run}",
                           "checkpoint.every_steps=2", EVERY_LOGGER, *TINY_MOPD_SMALL, *PACKED, *SLOW_TRAIN_STEP],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ, **LOGGER_SECRETS))
    return run, proc

"""Checkpoint keep-best (ckpt/retention.py, rl/checkpointing.py): real checkpoints written by
save_checkpoint, a validation's metrics beside each, retention keeping the best by
checkpoint.best_metric through a simulated requeue (a fresh process knows only the disk)."""

from __future__ import annotations

import logging

import pytest
import torch

from hpc_rl.ckpt import apply_retention, find_resumable, list_checkpoints, model_fingerprint, save_checkpoint
from hpc_rl.ckpt.retention import VALIDATION, read_metric, write_validation
from hpc_rl.config.schema import RunConfig
from hpc_rl.models.assets import ModelSpec, save_untrained
from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig
from hpc_rl.observe.metrics import flatten
from hpc_rl.rl.checkpointing import Checkpointer

SPEC = ModelSpec(hidden=32, intermediate=64, layers=1, heads=1, max_positions=64)
RECIPE = "test_recipe"
CONFIG_YAML = f"recipe: {RECIPE}\n"
METRIC = "val/accuracy_mean"
# the validation's accuracy mean at each step: best at 3, then 5, then 8 (after the requeue)
ACCURACY = {1: 0.20, 2: 0.30, 3: 0.70, 4: 0.40, 5: 0.65, 6: 0.10, 7: 0.50, 8: 0.90}


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    torch.manual_seed(0)
    return FSDP2Backend(str(save_untrained(tmp_path_factory.mktemp("tiny"), SPEC, seed=0)),
                        optim=OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0))


def _eval_record(step: int) -> dict:
    """A validation record as rl/eval.py writes it to metrics.jsonl."""
    acc = {"add_agent": ACCURACY[step] + 0.05, "mul_agent": ACCURACY[step] - 0.05}
    return {"kind": "eval", "tag": "step", "step": step, "accuracy": acc, "accuracy_mean": ACCURACY[step],
            "reverse_kl": {"add": 1.0 - ACCURACY[step], "mean": 1.0 - ACCURACY[step]}, "prompts": 8}


def _steps(root) -> list:
    return [s for s, _ in list_checkpoints(root)]


def _save_and_validate(root, backend, step: int, keep_best: int, **kw) -> None:
    """What the loop does at a validation step: save (its retention runs before the metric
    exists), validate, write the metric beside the checkpoint, apply retention again."""
    save_checkpoint(root, step, backend, {"step": step}, CONFIG_YAML)
    apply_retention(root, keep_last=1, keep_best=keep_best, **kw)
    write_validation(root, step, flatten(_eval_record(step))[1])
    apply_retention(root, keep_last=1, keep_best=keep_best, **kw)


def test_the_best_checkpoints_stay_through_retention_and_a_requeue(backend, tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 7):
        _save_and_validate(root, backend, step, keep_best=2)
    assert _steps(root) == [3, 5, 6]  # newest (keep_last=1) and the best two by val/accuracy_mean
    assert read_metric(root / "step_00000003", METRIC) == 0.70
    # the metric names are the loggers' (observe/metrics.py), so best_metric can name any of them
    assert read_metric(root / "step_00000005", "val/accuracy/add_agent") == pytest.approx(0.70)

    # requeue: a new process resumes from the newest checkpoint; the metrics are on disk
    scan = find_resumable(root, model_fingerprint(backend.model), RECIPE)
    assert scan.step == 6 and scan.skipped == []  # validation.json beside it does not spoil verification
    for step in (7, 8):
        _save_and_validate(root, backend, step, keep_best=2)
    assert _steps(root) == [3, 8]  # 8 is newest and best; 3 second best (0.70 > 0.65 of step 5)

    # min mode on another metric: the lowest reverse KL (the highest accuracy here) stays
    apply_retention(root, keep_last=1, keep_best=1, best_metric="val/reverse_kl/mean", best_mode="min")
    assert _steps(root) == [8]


def test_a_checkpoint_without_a_metric_is_never_ranked(backend, tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        save_checkpoint(root, step, backend, {"step": step}, CONFIG_YAML)
    write_validation(root, 1, {METRIC: 0.5})
    (root / "step_00000002" / VALIDATION).write_text("{not json")  # unreadable: unranked, not fatal
    apply_retention(root, keep_last=1, keep_best=1)
    assert _steps(root) == [1, 3]
    assert write_validation(root, 9, {METRIC: 1.0}) is None  # no checkpoint at that step: nothing written


def test_the_checkpointer_saves_at_validation_steps_and_records_the_metric(backend, tmp_path):
    cfg = RunConfig()
    cfg.run.max_steps = 100
    cfg.checkpoint.every_steps, cfg.checkpoint.keep_last, cfg.checkpoint.keep_best = 50, 1, 1
    cfg.data.eval_prompts_per_task, cfg.data.validation.every_steps = 8, 3
    ck = object.__new__(Checkpointer)  # the pieces record_validation and due use, without a job
    ck.cfg, ck.is_driver, ck.root, ck.log = cfg, True, tmp_path / "checkpoints", logging.getLogger("test")
    assert [s for s in range(1, 13) if ck.due(s)] == [3, 6, 9, 12]  # every validation step
    cfg.checkpoint.keep_best = 0
    assert not ck.due(3) and ck.due(50) and ck.due(100)
    cfg.checkpoint.keep_best = 1
    for step in (3, 6):
        save_checkpoint(ck.root, step, backend, {"step": step}, CONFIG_YAML)
        ck.last_saved = step
        ck.record_validation(step, _eval_record(step))
    assert _steps(ck.root) == [3, 6]  # newest, and the best (0.70 at step 3)
    ck.record_validation(0, _eval_record(1))  # the start's step 0 has no checkpoint: nothing happens
    ck.record_validation(6, None)  # not the driver's record
    assert read_metric(ck.root / "step_00000006", METRIC) == ACCURACY[6]

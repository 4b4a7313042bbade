"""Rules of data.validation and of checkpoint keep-best (which ranks checkpoints by what a
validation emits); validate.py's check_data calls check_validation. The validation file
itself (readable, rows held out from training) is checked with the data, by rl/inputs.py."""

from __future__ import annotations

from typing import List

from .errors import Violation
from .schema import RunConfig


def check_validation(out: List[Violation], cfg: RunConfig) -> None:
    d, v = cfg.data, cfg.data.validation
    on = d.eval_prompts_per_task > 0
    if not 0 <= v.split < 1:
        out.append(Violation("data.validation.split", v.split, "must be in [0, 1): the share of the items held out",
                             "e.g. data.validation.split=0.1"))
    elif on and not v.path and v.split == 0:
        # evaluating on training prompts measures memorisation: there must be a held-out set
        out.append(Violation("data.validation.split", v.split,
                             f"with data.validation.path unset and validation on (data.eval_prompts_per_task="
                             f"{d.eval_prompts_per_task}), a split of 0 leaves no held-out prompt",
                             "set data.validation.split in (0, 1), data.validation.path to a held-out JSONL file, or "
                             "data.eval_prompts_per_task=0 to turn validation off"))
    if v.every_steps < 0:
        out.append(Violation("data.validation.every_steps", v.every_steps, "must be >= 0",
                             "0 validates at the start and the end only"))
    elif v.every_steps > 0 and on and cfg.algo.async_rollout.enabled:
        out.append(Violation("data.validation.every_steps", v.every_steps,
                             "validation between steps is not supported with asynchronous rollouts in this version: "
                             "the engines then hold an older step's weights and the pipeline has an order outstanding",
                             "set data.validation.every_steps=0 (start and end validations still run) or "
                             "algo.async_rollout.enabled=false"))
    if v.k < 1:
        out.append(Violation("data.validation.k", v.k, "must be >= 1 (samples per prompt; 1: greedy accuracy only)",
                             "e.g. data.validation.k=8 for pass@8"))
    if not v.temperature > 0:
        out.append(Violation("data.validation.temperature", v.temperature,
                             "must be > 0: pass@k and mean@k sample (greedy is the accuracy's)", "e.g. 1.0"))
    _check_keep_best(out, cfg, on)


def _check_keep_best(out: List[Violation], cfg: RunConfig, on: bool) -> None:
    from hpc_rl.observe.metrics import validation_metrics

    ck, v = cfg.checkpoint, cfg.data.validation
    if ck.keep_best < 0:
        out.append(Violation("checkpoint.keep_best", ck.keep_best, "must be >= 0", "0 turns keep-best off"))
    if ck.keep_best <= 0:
        return
    if not on or v.every_steps <= 0:
        out.append(Violation("checkpoint.keep_best", ck.keep_best,
                             "keep-best ranks checkpoints by the validation between steps, which is off "
                             f"(data.eval_prompts_per_task={cfg.data.eval_prompts_per_task}, "
                             f"data.validation.every_steps={v.every_steps})",
                             "set data.eval_prompts_per_task > 0 and data.validation.every_steps > 0, "
                             "or checkpoint.keep_best=0"))
        return
    names, per_task = validation_metrics(v.k, cfg.algo.name == "mopd" and bool(cfg.teachers))
    if ck.best_metric not in names and not ck.best_metric.startswith(per_task):
        out.append(Violation("checkpoint.best_metric", ck.best_metric, "validation does not emit this metric",
                             f"choose one of {list(names)} or a task's {', '.join(p + '<task>' for p in per_task)}"
                             + ("" if v.k > 1 else " (pass@k and mean@k need data.validation.k > 1)")))

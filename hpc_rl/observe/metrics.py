"""One naming of a run's metrics, shared by every logger and the plots.

A record that `MetricsLog.append` gets (hpc_rl/rl/step_record.py, hpc_rl/rl/eval.py) is a
nested dict; loggers want flat scalar names on a step axis. The rule:

  - the axis is the record's `step` (training step; the start evaluation is step 0 or the
    step a resumed run starts from, the end evaluation the last step);
  - nested dicts join with '/': {"reverse_kl": {"add": x}} -> `reverse_kl/add`,
    {"timing": {"generate_s": x}} -> `timing/generate_s`;
  - a record of kind "step" keeps its names; any other kind K is prefixed `K/`, except the
    validation's (kind "eval", rl/eval.py), prefixed `val/`: its accuracy is
    `val/accuracy/add_agent` next to the training batch's `accuracy/add_agent`, with
    `val/accuracy_mean` (checkpoint.best_metric's default), `val/pass_at_k/<task>`,
    `val/mean_at_k/<task>` (data.validation.k > 1; `val/k` says which k), `val/reverse_kl/<teacher>`
    (the start, every_steps and end validations are one series, told apart by step);
  - `kind`, `tag`, `step` and `time` are the record's coordinates, not metrics; strings,
    lists, None and non-finite numbers (metrics.jsonl writes null) are left out;
  - characters outside [A-Za-z0-9_.-/ ] become '_': MLflow refuses them in names, and the
    names must be the same in every backend.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Iterable, List, Mapping, Tuple

COORDINATES = ("kind", "tag", "step", "time")
STEP_KIND = "step"
EVAL_KIND, VAL_PREFIX = "eval", "val"  # metrics.jsonl keeps "kind": "eval"; the loggers' names say val/
SEP = "/"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-/ ]")


def metric_name(*parts: str) -> str:
    return SEP.join(_UNSAFE.sub("_", str(p)) for p in parts)


def _walk(prefix: Tuple[str, ...], value: Any, out: Dict[str, float]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _walk(prefix + (str(k),), v, out)
    elif isinstance(value, (bool, int, float)) and not isinstance(value, str):
        x = float(value)
        if math.isfinite(x):
            out[metric_name(*prefix)] = x


def flatten(record: Mapping[str, Any]) -> Tuple[int, Dict[str, float]]:
    """(step, {name: value}) of one metrics record, by the rule in the module docstring."""
    kind = record.get("kind", STEP_KIND)
    prefix: Tuple[str, ...] = () if kind == STEP_KIND else (VAL_PREFIX if kind == EVAL_KIND else str(kind),)
    out: Dict[str, float] = {}
    for k, v in record.items():
        if k not in COORDINATES:
            _walk(prefix + (k,), v, out)
    return int(record.get("step", 0)), out


def series(records: Iterable[Mapping[str, Any]]) -> Dict[str, List[Tuple[int, float]]]:
    """name -> [(step, value), ...] in record order: what the plots draw."""
    out: Dict[str, List[Tuple[int, float]]] = {}
    for rec in records:
        step, flat = flatten(rec)
        for name, value in flat.items():
            out.setdefault(name, []).append((step, value))
    return out


def validation_metrics(k: int, distill: bool) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(names, per-task prefixes) of what a validation emits (rl/eval.py's record through
    flatten): what checkpoint.best_metric may name (config/validate_data.py)."""
    names, per_task = [f"{VAL_PREFIX}/accuracy_mean"], [f"{VAL_PREFIX}/accuracy/"]
    if k > 1:
        names += [f"{VAL_PREFIX}/pass_at_k_mean", f"{VAL_PREFIX}/mean_at_k_mean"]
        per_task += [f"{VAL_PREFIX}/pass_at_k/", f"{VAL_PREFIX}/mean_at_k/"]
    if distill:
        names.append(f"{VAL_PREFIX}/reverse_kl/mean")
        per_task.append(f"{VAL_PREFIX}/reverse_kl/")
    return tuple(names), tuple(per_task)

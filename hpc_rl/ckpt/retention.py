"""Checkpoint retention: which complete checkpoints stay after a save.

The newest `keep_last`, every `keep_every`-th step's, always the newest one whose weights
were finite when saved (the manifest's `weights_finite`, checkpoint.py): should NaN weights
ever get past the trainer's non-finite guard (models/nonfinite.py), `keep_last` saves of them
would otherwise delete every checkpoint a run could restart from; and with `keep_best` the
best ones by a validation metric (checkpoint.best_metric, best_mode).

A validation runs after its step's checkpoint is published, so its metrics go beside it, in
`<step dir>/validation.json` (written atomically, outside the manifest, which verification
alone reads): on disk with the checkpoint they outlive a requeue, and they go when it goes.
A checkpoint without the metric (no validation at its step) is never ranked.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .checkpoint import _TMP_PREFIX, MANIFEST, CorruptCheckpointError, list_checkpoints, read_manifest, step_dirname

log = logging.getLogger(__name__)
VALIDATION = "validation.json"


def write_validation(root, step: int, metrics: Dict[str, float]) -> Optional[Path]:
    """Put a validation's flat metrics (observe/metrics.py names) beside the complete
    checkpoint of `step`; None (nothing written) when there is none."""
    ckpt = Path(root) / step_dirname(step)
    if not (ckpt / MANIFEST).is_file():
        return None
    path, tmp = ckpt / VALIDATION, ckpt / f"{_TMP_PREFIX}{VALIDATION}"
    tmp.write_text(json.dumps({"step": step, "metrics": metrics}, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_metric(ckpt: Path, name: str) -> Optional[float]:
    """The validation metric `name` of a checkpoint; None when it has none (or it is unreadable
    or not finite: such a checkpoint cannot be ranked)."""
    try:
        value = json.loads((Path(ckpt) / VALIDATION).read_text())["metrics"][name]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def best(complete: List[Tuple[int, Path]], n: int, metric: str, mode: str = "max") -> List[Path]:
    """The `n` best of these (step, path) checkpoints by their validation `metric` (mode max:
    highest first; min: lowest); a tie goes to the newer step."""
    ranked = [(v, step, p) for step, p in complete if (v := read_metric(p, metric)) is not None]
    sign = -1.0 if mode == "max" else 1.0
    ranked.sort(key=lambda t: (sign * t[0], -t[1]))
    return [p for _, _, p in ranked[:n]]


def newest_finite(complete: List[Tuple[int, Path]]) -> Optional[Path]:
    """The newest of these (step, path) checkpoints whose manifest does not say its weights
    were non-finite (checkpoints from before the check say nothing: taken as finite); an
    unreadable manifest proves nothing, so it is passed over."""
    for _, p in reversed(complete):
        try:
            if read_manifest(p).get("weights_finite", True) is not False:
                return p
        except CorruptCheckpointError:
            continue
    return None


def apply_retention(root, keep_last: int, keep_every: Optional[int] = None, keep_best: int = 0,
                    best_metric: str = "val/accuracy_mean", best_mode: str = "max") -> List[Path]:
    """Keep the newest `keep_last` complete checkpoints, every one whose step is a multiple of
    `keep_every`, the newest one with finite weights and the `keep_best` best by their
    validation's `best_metric` (`best_mode`); delete the others, step directories
    without a manifest, and stale `.tmp_*` entries. Call it only while no save is in flight
    (the trainer does, right after a save). Returns the deleted paths."""
    if keep_last < 1:
        # The newest checkpoint is the one a requeue resumes from; never delete it.
        raise ValueError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    if not root.is_dir():
        return []
    complete, incomplete = [], []
    for step, p in list_checkpoints(root):
        (complete if (p / MANIFEST).is_file() else incomplete).append((step, p))
    keep = {p for _, p in complete[-keep_last:]}
    if keep_every:
        keep |= {p for step, p in complete if step % keep_every == 0}
    if keep_best > 0:
        keep |= set(best(complete, keep_best, best_metric, best_mode))
    finite = newest_finite(complete)
    if finite is not None and finite not in keep:
        log.warning("checkpoint retention keeps %s: none of the newest %d has finite weights", finite.name, keep_last)
        keep.add(finite)
    doomed = [p for _, p in complete if p not in keep] + [p for _, p in incomplete]
    doomed += [p for p in root.iterdir() if p.name.startswith(_TMP_PREFIX)]
    for p in doomed:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if doomed:
        log.info("checkpoint retention removed %s", [p.name for p in doomed])
    return doomed

"""Checkpoint retention: which complete checkpoints stay after a save.

The newest `keep_last`, every `keep_every`-th step's, and always the newest one whose weights
were finite when saved (the manifest's `weights_finite`, checkpoint.py): should NaN weights
ever get past the trainer's non-finite guard (models/nonfinite.py), `keep_last` saves of them
would otherwise delete every checkpoint a run could restart from.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import List, Optional, Tuple

from .checkpoint import _TMP_PREFIX, MANIFEST, CorruptCheckpointError, list_checkpoints, read_manifest

log = logging.getLogger(__name__)


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


def apply_retention(root, keep_last: int, keep_every: Optional[int] = None) -> List[Path]:
    """Keep the newest `keep_last` complete checkpoints, every one whose step is a multiple of
    `keep_every`, and the newest one with finite weights; delete the others, step directories
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

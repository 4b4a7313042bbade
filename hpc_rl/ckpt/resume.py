"""Choosing the checkpoint a run resumes from: the newest complete one, verified, written for
this recipe and this model (a mismatch is refused, never silently resumed)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .checkpoint import _MAX_LISTED, CorruptCheckpointError, Fingerprint, IncompatibleCheckpointError, list_checkpoints, verify_checkpoint

log = logging.getLogger(__name__)


@dataclass
class ResumeScan:
    """What `find_resumable` found: the checkpoint to resume from (None: start fresh) and the
    newer checkpoints it had to skip, each with the reason."""

    path: Optional[Path] = None
    step: Optional[int] = None
    skipped: List[Tuple[Path, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.path is not None


def _fresh_hint(root: Path) -> str:
    return ("to start fresh, set checkpoint.resume=false (existing checkpoints are then ignored and "
            "overwritten) or checkpoint.dir=<new dir>; to resume from it, run the recipe and model it was written for")


def check_compatible(manifest: Dict[str, Any], fingerprint: Fingerprint, recipe: Optional[str], path: Path) -> None:
    problems = []
    if manifest.get("recipe") != recipe:
        problems.append(f"recipe {manifest.get('recipe')!r} (checkpoint) vs {recipe!r} (this run)")
    saved = {k: list(v) for k, v in manifest["fingerprint"].items()}
    now = {k: list(v) for k, v in fingerprint.items()}
    diffs = []
    for name in sorted(saved.keys() | now.keys()):
        if name not in now:
            diffs.append(f"parameter {name} only in the checkpoint (shape {saved[name]})")
        elif name not in saved:
            diffs.append(f"parameter {name} missing from the checkpoint (this run: shape {now[name]})")
        elif saved[name] != now[name]:
            diffs.append(f"parameter {name} shape {saved[name]} (checkpoint) vs {now[name]} (this run)")
    problems += diffs[:_MAX_LISTED]
    if len(diffs) > _MAX_LISTED:
        problems.append(f"... and {len(diffs) - _MAX_LISTED} more parameter differences")
    if problems:
        raise IncompatibleCheckpointError(
            f"checkpoint {path} does not match this run: " + "; ".join(problems) + f". {_fresh_hint(path.parent)}")


def find_resumable(root, fingerprint: Fingerprint, recipe: Optional[str]) -> ResumeScan:
    """The newest complete checkpoint under root, verified; corrupt ones are skipped (logged and
    listed in `.skipped`) for the previous one. Raises IncompatibleCheckpointError when that
    checkpoint was written for another recipe or model: resuming it silently would train the
    wrong thing."""
    root = Path(root)
    scan = ResumeScan()
    for step, path in reversed(list_checkpoints(root)):
        try:
            manifest = verify_checkpoint(path)
        except CorruptCheckpointError as e:
            log.warning("skipping checkpoint: %s", e)
            scan.skipped.append((path, str(e)))
            continue
        check_compatible(manifest, fingerprint, recipe, path)
        scan.path, scan.step = path, int(manifest["step"])
        break
    return scan

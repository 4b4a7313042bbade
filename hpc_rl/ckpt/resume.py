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


class MixedRunsError(RuntimeError):
    """checkpoint.resume=false over a directory that already holds checkpoints."""

    no_retry = True  # a requeue would meet the same checkpoints: the batch shell does not retry


def fresh_start_conflict(root) -> Optional[str]:
    """Why a fresh run (checkpoint.resume=false) cannot save under `root`; None when it holds no
    checkpoint. Retention keeps the newest steps: an earlier run's higher steps would outlive
    this run's saves, which it deletes, and a later resume would pick the earlier run's."""
    found = list_checkpoints(root)
    if not found:
        return None
    return (f"{root} already holds {len(found)} checkpoint(s), the newest {found[-1][1].name}: a fresh run there would "
            f"mix with them (retention keeps the newest steps, theirs, deleting this run's saves; a later resume picks theirs)")


def fresh_start_fix(root) -> str:
    return (f"start fresh in a new directory (another run.dir, or none: each launch makes its own; another checkpoint.dir "
            f"if it is set), continue those checkpoints with checkpoint.resume=true, or delete {root}")


def _fresh_hint(root: Path) -> str:
    return ("to start fresh, use a new run.dir (or none: each launch makes its own) or checkpoint.dir=<new dir>, "
            f"or delete {root}; to resume from it, run the recipe and model it was written for")


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
    """The newest complete checkpoint under root, verified; corrupt ones, and ones whose weights
    were not finite when saved (training them again would only repeat non-finite steps), are
    skipped (logged and listed in `.skipped`) for the previous one. Raises IncompatibleCheckpointError when that
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
        if manifest.get("weights_finite") is False:  # retention keeps an older finite one (retention.py)
            why = f"{path}: its weights were not finite (NaN or inf) when it was saved"
            log.warning("skipping checkpoint: %s", why)
            scan.skipped.append((path, why))
            continue
        scan.path, scan.step = path, int(manifest["step"])
        break
    return scan

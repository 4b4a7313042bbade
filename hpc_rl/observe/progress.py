"""Reading a run's progress.json (written by hpc_rl/rl/records.py's `Progress`): the
launcher's progress bar and the live view read it from the run directory alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from hpc_rl.rundir import RunDir


def read_progress(run_dir: Path) -> Optional[dict]:
    p = RunDir(run_dir).progress
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def progress_line(p: Mapping[str, Any], width: int = 24) -> str:
    total = max(int(p.get("total_steps") or 1), 1)
    done = min(max(int(p.get("step", 1)) - 1, 0), total)
    if p.get("phase") in ("done", "eval end"):
        done = total
    filled = int(width * done / total)
    eta = p.get("eta_s")
    eta_s = f"ETA {int(eta) // 60}:{int(eta) % 60:02d}" if eta is not None else "ETA --:--"
    return f"[{'#' * filled}{'.' * (width - filled)}] step {min(int(p.get('step', 0)), total)}/{total} {p.get('phase', ''):<10} {eta_s}"

"""The run directory: one per run, holding everything the job side reads and writes.

config.yaml (the resolved config; ranks read this file, never Hydra state), plan.json,
logs/ (per role, per restart), metrics.jsonl and checkpoints/ as later phases add them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hpc_rl.config.compose import to_yaml
from hpc_rl.config.schema import RunConfig
from hpc_rl.plan.job_plan import JobPlan


def choose_run_dir(cfg: RunConfig) -> Path:
    if cfg.run.dir:
        return Path(cfg.run.dir)
    name = cfg.run.name or cfg.recipe or "run"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.run.root_dir) / f"{name}-{stamp}"
    path, k = base, 1
    while path.exists():  # two launches in one second get distinct directories
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare_run_dir(cfg: RunConfig, plan: JobPlan) -> Path:
    run_dir = choose_run_dir(cfg).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.yaml", to_yaml(cfg))
    write_atomic(run_dir / "plan.json", plan.to_json())
    return run_dir

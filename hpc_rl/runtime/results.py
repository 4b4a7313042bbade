"""Rank outcomes as submitit result pickles, one per global rank.

`<run_dir>/submitit/<job id>_<global rank>_result.pkl` holds ("success", value) or
("error", traceback): the files a submitit `Job(folder, job_id, tasks)` reads, so
`job.results()` / `job.task(k).result()` work on our het jobs too.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from submitit.core import utils as submitit_utils

from hpc_rl.rundir import RunDir

from .env import RankEnv


def submitit_folder(run_dir: Path) -> Path:
    return RunDir(run_dir).submitit


def result_paths(run_dir: Path, job_id: str, global_rank: int) -> submitit_utils.JobPaths:
    return submitit_utils.JobPaths(submitit_folder(run_dir), job_id=job_id, task_id=global_rank)


def _global_rank(run_dir: Path) -> int:
    """This task's global rank, or -1 when the run directory or environment is unusable
    (the rank then fails inside `fn` with the precise reason)."""
    from hpc_rl.plan.job_plan import JobPlan

    from .identity import identity_from_env

    try:
        plan = JobPlan.from_dict(json.loads(RunDir(run_dir).plan.read_text()))
        return identity_from_env(plan).global_rank
    except Exception:
        return -1


def record_failure(run_dir: Path, role: str, rank: str, restart: str, tb: str) -> None:
    path = RunDir(run_dir).error_report(role, rank, restart)
    path.parent.mkdir(parents=True, exist_ok=True)
    last = tb.strip().splitlines()[-1] if tb.strip() else "unknown error"
    path.write_text(f"{role}:{rank}: {last}\n\n{tb}")


def run_and_record(run_dir: Path, fn: Callable[[], Any]) -> int:
    try:
        launched = RankEnv.from_env()
    except ValueError:  # a malformed variable: the rank fails inside `fn` naming it; still record it
        launched = RankEnv()
    job_id = launched.job_id or "local"
    role = launched.role or "unknown"
    rank = "?" if launched.role_rank is None else str(launched.role_rank)
    restart = str(launched.restart or 0)
    provisional = _global_rank(run_dir)

    def placed() -> RankEnv:
        # run_rank sets the placed ranks in this process's environment once placement is done
        try:
            return RankEnv.from_env()
        except ValueError:
            return launched

    def paths() -> submitit_utils.JobPaths:
        # placement may renumber ranks at rendezvous (HPC_RL_PLACED_RANK): task k of the
        # submitit job is then global rank k of the placed job
        g = placed().placed_rank
        p = result_paths(run_dir, job_id, provisional if g is None else g)
        p.folder.mkdir(parents=True, exist_ok=True)
        return p

    try:
        result = fn()
    except BaseException:
        tb = traceback.format_exc()
        placed_role_rank = placed().placed_role_rank
        record_failure(run_dir, role, rank if placed_role_rank is None else placed_role_rank, restart, tb)
        with submitit_utils.temporary_save_path(paths().result_pickle) as tmp:
            submitit_utils.cloudpickle_dump(("error", tb), tmp)
        print(tb, file=sys.stderr, flush=True)
        return 1
    with submitit_utils.temporary_save_path(paths().result_pickle) as tmp:
        submitit_utils.cloudpickle_dump(("success", result), tmp)
    return 0

"""`launcher=slurm`: preflight against the live cluster, submit one het job through the
submitit-based executor, print how to follow it, and (launcher.wait=true) follow it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from hpc_rl.config.schema import RunConfig
from hpc_rl.plan.job_plan import JobPlan
from hpc_rl.plan.report import describe
from hpc_rl.rundir import RunDir
from hpc_rl.runtime.worker import run_rank
from hpc_rl.slurm.executor import HetJob, HetSlurmExecutor
from hpc_rl.slurm.preflight import check_slurm
from hpc_rl.slurm.watch import follow, summarize

from .report import print_summary


def interpreter(cfg: RunConfig) -> str:
    """Bare metal from this machine: the interpreter that launched us (its environment has
    hpc_rl); inside a container: launcher.slurm.python as configured."""
    return cfg.launcher.slurm.python if cfg.container.image else sys.executable


def submit(cfg: RunConfig, plan: JobPlan, run_dir: Path, overrides: Sequence[str] = ()) -> HetJob:
    executor = HetSlurmExecutor(cfg, plan, run_dir, interpreter(cfg), overrides)
    return executor.submit_run(run_rank, str(run_dir))


def launch_slurm(cfg: RunConfig, plan: JobPlan, run_dir: Path, overrides: Sequence[str] = ()) -> int:
    job = submit(cfg, plan, run_dir, overrides)
    comps = ", ".join(f"{role}={cid}" for role, cid in zip(job.roles, job.component_ids))
    print(f"submitted het job {job.job_id} ({comps})")
    print(f"run directory: {run_dir}")
    print(f"  follow:  python -m hpc_rl.slurm.watch {run_dir}    (or: squeue -j {job.job_id})")
    print(f"  logs:    tail -f {RunDir(run_dir).logs}/*.out")
    print(f"  cancel:  scancel {job.job_id}    (or: python -m hpc_rl.slurm.watch {run_dir} --cancel)")
    if not cfg.launcher.wait:
        return 0
    state = follow(job, poll_s=cfg.launcher.poll_s)
    print(f"job {job.job_id} {state}\n{summarize(job)}")
    if state == "COMPLETED":
        print_summary(run_dir)
    return 0 if state == "COMPLETED" else 1


class SlurmLauncher:
    """Submit one het job; return once it is queued (or, with launcher.wait, once it ends)."""

    name = "slurm"
    starts_ranks = True

    def preflight(self, cfg: RunConfig, plan: JobPlan) -> None:
        # sbatch exists, the partition exists and every role fits: asked of the live cluster
        # before the run directory exists, so a refused launch leaves nothing behind
        check_slurm(cfg, plan)

    def launch(self, cfg: RunConfig, plan: JobPlan, run_dir: RunDir, overrides: Sequence[str] = ()) -> int:
        print(describe(cfg, plan) + "\n")
        return launch_slurm(cfg, plan, run_dir.path, overrides)

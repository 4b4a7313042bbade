"""Run a pipeline: check every stage, then submit the stages as Slurm jobs chained with
`--dependency=afterok:<ids>` (the teachers run side by side, MOPD waits for all of them).

Each stage is submitted as `python -m hpc_rl.launch ... launcher=slurm` submits a run: its run
directory <pipeline dir>/<stage> (config.yaml, plan.json, generated data), then one het job
through launchers/slurm.submit. A dependency that can never be met (an upstream stage failed
past its retry budget) makes Slurm cancel the dependent (sbatch.py renders
--kill-on-invalid-dep=yes with every dependency), so nothing waits forever.

Running the same command again in the same pipeline directory skips finished stages, keeps
stages still queued or running, resubmits a failed (or cancelled) stage into its own run
directory, where it resumes from its newest checkpoint, and resubmits its dependents.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from hpc_rl.config.errors import ConfigError

from .compose import StageCheck, check_all, stage_dir, submit_config
from .spec import CommandLine, PipelineSpec
from .state import ALIVE, DONE, NOT_SUBMITTED, PipelineRecord, StageRecord, archive_attempt, refresh


def layout(check: StageCheck) -> Dict[str, dict]:
    assert check.plan is not None
    return {r.name: {"nodes": r.nodes, "gpus_per_node": r.gpus_per_node, "tasks_per_node": r.tasks_per_node,
                     "segment_size": r.segment_size, **{k: v for k, v in r.parallel.items()}} for r in check.plan.roles}


def new_record(spec: PipelineSpec, checks: List[StageCheck], pdir: Path, argv: Sequence[str]) -> PipelineRecord:
    stages = {}
    for c in checks:
        s = spec.stages[c.name]
        assert c.plan is not None
        stages[c.name] = StageRecord(name=c.name, recipe=s.recipe, after=s.deps(), inputs=c.inputs,
                                     run_dir=str(stage_dir(pdir, c.name)), overrides=c.overrides,
                                     nodes=c.plan.total_nodes, layout=layout(c))
    return PipelineRecord(name=spec.name, dir=str(pdir), command=list(argv), stages=stages,
                          edges=[list(e) for e in spec.edges()])


def _merge(old: Optional[PipelineRecord], new: PipelineRecord) -> PipelineRecord:
    """The new command's stages, with the job ids of the earlier runs of this directory."""
    if old is None:
        return new
    if old.name != new.name:
        raise ConfigError([_violation("pipeline.dir", new.dir, f"holds pipeline {old.name!r}, not {new.name!r}",
                                      "choose another pipeline.dir")])
    for name, s in new.stages.items():
        prev = old.stages.get(name)
        if prev is not None:
            s.job_id, s.jobs = prev.job_id, list(prev.jobs)
    new.created = old.created
    return refresh(new)


def _violation(key, value, problem, fix):
    from hpc_rl.config.errors import Violation

    return Violation(key, value, problem, fix)


def submit_stage(check: StageCheck, pdir: Path, after_ids: List[str]) -> str:
    """One stage as one het job; returns its job id."""
    from hpc_rl.launchers.slurm import submit
    from hpc_rl.rl.inputs import write_generated
    from hpc_rl.rundir import RunDir, private_umask

    cfg, overrides = submit_config(check, pdir)
    cfg.launcher.slurm.dependency = f"afterok:{':'.join(after_ids)}" if after_ids else None
    assert check.plan is not None
    with private_umask(RunDir.mode(cfg)):  # as launch.py: what ranks execute is run.dir_mode at most
        run_dir = RunDir.create(cfg, check.plan)
        if cfg.run.program == "rl":
            write_generated(cfg, run_dir.path)
        job = submit(cfg, check.plan, run_dir.path, overrides)
    return str(job.job_id)


def run(spec: PipelineSpec, cli: CommandLine, pdir: Path, argv: Sequence[str], out=sys.stdout) -> PipelineRecord:
    """Check every stage (raising one ConfigError for all of them), then submit what is not
    finished or under way. Returns the pipeline record, saved to pipeline.json."""
    checks = check_all(spec, cli, pdir)
    rec = _merge(PipelineRecord.load(pdir), new_record(spec, checks, pdir, argv))
    rec.cancelled = False
    by_name = {c.name: c for c in checks}
    dry = any(c.cfg is not None and c.cfg.launcher.name == "dry_run" for c in checks)
    if dry:
        return rec
    for name in spec.order():
        s = rec.stages[name]
        if s.state == DONE:
            print(f"  {name:<20} finished: skipped", file=out)
            continue
        if s.state in ALIVE and s.job_id:
            print(f"  {name:<20} job {s.job_id} {s.state.lower()}: kept", file=out)
            continue
        if s.job_id:  # failed or cancelled: its dependents were cancelled with it, resubmit both
            archive_attempt(Path(s.run_dir), s.job_id)
        ups = [rec.stages[u] for u in s.after]
        after_ids = [u.job_id for u in ups if u.state != DONE and u.job_id]
        s.job_id = submit_stage(by_name[name], pdir, after_ids)
        s.jobs.append(s.job_id)
        s.state, s.reason = "PENDING", (f"after {', '.join(u.name for u in ups if u.state != DONE)}" if after_ids else "")
        verb = "resubmitted" if len(s.jobs) > 1 else "submitted"
        deps = f" --dependency=afterok:{':'.join(after_ids)}" if after_ids else ""
        print(f"  {name:<20} {verb} as job {s.job_id}{deps}", file=out)
        rec.save()
    rec.save()
    return rec


def cancel(pdir: Path) -> PipelineRecord:
    """scancel every stage that is queued or running; finished stages stay finished."""
    import subprocess

    rec = PipelineRecord.load(pdir)
    if rec is None:
        raise FileNotFoundError(f"{pdir}: no pipeline.json")
    refresh(rec)
    ids = [s.job_id for s in rec.stages.values() if s.job_id and s.state in ALIVE + ("UNKNOWN",)]
    if ids:
        subprocess.run(["scancel", *ids], check=False)
    rec.cancelled = True
    rec.save()
    return rec


def wait(pdir: Path, timeout_s: float = 3600, poll_s: float = 5.0) -> PipelineRecord:
    """Until no stage is queued or running (finished, failed or cancelled)."""
    t0 = time.monotonic()
    while True:
        rec = PipelineRecord.load(pdir)
        assert rec is not None
        refresh(rec)
        rec.save()
        if not any(s.state in ALIVE for s in rec.stages.values()) or time.monotonic() - t0 > timeout_s:
            return rec
        time.sleep(poll_s)


def finished(rec: PipelineRecord) -> bool:
    return all(s.state == DONE for s in rec.stages.values())


def pending_names(rec: PipelineRecord) -> List[str]:
    return [n for n, s in rec.stages.items() if s.state == NOT_SUBMITTED]

"""pipeline.json and each stage's state, from the stage's run directory and Slurm.

A stage's state comes from the most trusted source that knows it:
  1. its run directory: FINISHED (COMPLETED), or job_exit.json of its current job (the batch
     shell's verdict: FAILED with the error, or a requeue under way);
  2. Slurm: sacct when accounting is on, else squeue (which forgets a job MinJobAge after it
     ends) -- a het job's components folded into one state;
  3. the DAG: a stage Slurm no longer knows, that never wrote a verdict, whose upstream stage
     failed, was cancelled by Slurm (--kill-on-invalid-dep) because of that failure.
The Slurm queries are the executor's (hpc_rl/slurm/executor.py: sacct_records,
squeue_records); this module asks them for the job ids pipeline.json records, and keeps
only the records of the stage's own job (its name and submit time, from the run directory's
job.json): accounting outlives job ids, so sacct can list a finished job of an earlier
cluster (a reset controller, wrapped ids) under the id of a stage that is only queued.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from hpc_rl.durable import write_atomic
from hpc_rl.rundir import RunDir
from hpc_rl.slurm.executor import sacct_records, squeue_records
from hpc_rl.slurm.states import TERMINAL_BAD, JobIdentity, aggregate_state, fitting, fitting_of

PIPELINE_FILE = "pipeline.json"
ATTEMPTS_DIR = "attempts"
DONE = "COMPLETED"
BAD = TERMINAL_BAD
ALIVE = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED", "REQUEUE_HOLD")
NOT_SUBMITTED = "NOT_SUBMITTED"


@dataclass
class StageRecord:
    name: str
    recipe: str
    after: List[str]  # upstream stages (checkpoint inputs and ordering edges)
    inputs: Dict[str, str]  # config key -> producing stage
    run_dir: str
    overrides: List[str]
    nodes: int = 0
    layout: Dict[str, dict] = field(default_factory=dict)  # role -> nodes and parallel sizes
    job_id: Optional[str] = None
    jobs: List[str] = field(default_factory=list)  # every job id this stage was submitted as
    state: str = NOT_SUBMITTED
    reason: str = ""


@dataclass
class PipelineRecord:
    name: str
    dir: str
    command: List[str]
    stages: Dict[str, StageRecord]
    edges: List[List[str]]
    created: float = field(default_factory=time.time)
    cancelled: bool = False

    def save(self) -> Path:
        path = Path(self.dir) / PIPELINE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, pdir: Path) -> Optional["PipelineRecord"]:
        path = Path(pdir) / PIPELINE_FILE
        if not path.exists():
            return None
        doc = json.loads(path.read_text())
        doc["stages"] = {k: StageRecord(**v) for k, v in doc["stages"].items()}
        return cls(**doc)


def slurm_states(job_ids: List[str], identities: Optional[Dict[str, JobIdentity]] = None) -> Dict[str, tuple]:
    """job id -> (state, Slurm's reason), per id from sacct where it lists the job, else
    squeue (the executor's queries and parsers); jobs neither knows are absent. With the
    job's identity (`identities`), a record of another job that had the id is not the job's
    (slurm/states.py fitting): seen when a fresh controller gave out ids that a database
    kept from an earlier one, and a queued stage read as COMPLETED."""
    ids = [j for j in job_ids if j]
    if not ids:
        return {}
    identities = identities or {}
    try:
        by_sacct = sacct_records(ids) or {}
    except (OSError, subprocess.TimeoutExpired):  # no sacct, or slurmdbd hangs
        by_sacct = {}
    own = {jid: fitting_of(by_sacct.get(jid), identities.get(jid))[0] for jid in ids}
    missing = [j for j in ids if own[j] is None]
    try:
        by_squeue = squeue_records(missing) if missing else {}
    except (OSError, subprocess.TimeoutExpired):
        by_squeue = {}
    out = {}
    for jid in ids:
        rec = own[jid] or fitting(by_squeue.get(jid), identities.get(jid))[0]
        if rec is not None and rec.components:
            out[jid] = (aggregate_state(rec.states().values()), rec.reason())
    return out


def stage_identity(run_dir: Path, job_id: Optional[str]) -> Optional[JobIdentity]:
    """The identity launchers/slurm.py recorded in the stage's job.json when it submitted
    `job_id` (None for another submission's file, or none)."""
    try:
        meta = json.loads(RunDir(run_dir).job_meta.read_text())
    except (OSError, ValueError):
        return None
    return JobIdentity.from_meta(meta) if job_id and str(meta.get("job_id")) == str(job_id) else None


def _exit_record(run_dir: Path, job_id: Optional[str]) -> Optional[dict]:
    try:
        rec = json.loads(RunDir(run_dir).job_exit.read_text())
    except (OSError, ValueError):
        return None
    return rec if job_id and str(rec.get("job_id")) == str(job_id) else None


def refresh(rec: PipelineRecord) -> PipelineRecord:
    """Each stage's state and reason, now; upstream failures explain cancelled dependents."""
    jobs = {s.job_id: Path(s.run_dir) for s in rec.stages.values() if s.job_id}
    known = slurm_states(list(jobs), {j: i for j, d in jobs.items() if (i := stage_identity(d, j)) is not None})
    for s in rec.stages.values():
        rd = Path(s.run_dir)
        if RunDir(rd).finished.exists():
            s.state, s.reason = DONE, ""
            continue
        if not s.job_id:
            s.state, s.reason = NOT_SUBMITTED, ""
            continue
        exit_rec = _exit_record(rd, s.job_id)
        slurm = known.get(s.job_id)
        if exit_rec is not None and not exit_rec.get("requeued") and int(exit_rec.get("exit_code", 1)) != 0:
            s.state, s.reason = "FAILED", str(exit_rec.get("detail") or f"role {exit_rec.get('failed_role')} failed")
        elif slurm is not None:
            s.state, s.reason = slurm
            if s.state == "PENDING" and s.reason == "DependencyNeverSatisfied":
                s.state = "CANCELLED"
        else:
            s.state, s.reason = "UNKNOWN", "Slurm no longer lists the job and it left no verdict"
    for name in _order(rec):  # upstream first: a cancelled stage names the failure that caused it
        s = rec.stages[name]
        if s.state in BAD + ("UNKNOWN",) and s.state != "FAILED":
            failed_up = [u for u in s.after if rec.stages[u].state in BAD]
            if failed_up:
                up = rec.stages[failed_up[0]]
                why = up.reason if up.state == "FAILED" else f"({up.reason})"
                s.state = "CANCELLED"
                s.reason = f"upstream stage {up.name} {up.state.lower()}: {why}"
        if s.state == "CANCELLED" and rec.cancelled and not s.reason:
            s.reason = "cancelled by `python -m hpc_rl.pipeline cancel`"
    return rec


def _order(rec: PipelineRecord) -> List[str]:
    done: List[str] = []
    pending = list(rec.stages)
    while pending:
        ready = [n for n in pending if all(u in done for u in rec.stages[n].after)] or pending[:1]
        done.append(ready[0])
        pending.remove(ready[0])
    return done


def archive_attempt(run_dir: Path, job_id: str) -> Optional[Path]:
    """Move the failed attempt's per-restart files aside before a new job uses the run
    directory: a new job counts restarts from 0 again, and the batch shell would read the old
    attempt's error reports, stop request or verdict as its own. Checkpoints, metrics, logs
    and restarts.jsonl stay: the new job resumes from them."""
    rd = RunDir(run_dir)
    if not rd.path.exists():
        return None
    dest = rd.path / ATTEMPTS_DIR / str(job_id)
    moved = False
    for p in [rd.errors, rd.job_exit, *rd.path.glob("stopped.*.json"), *rd.path.glob(".save_request.*")]:
        if p.exists():
            dest.mkdir(parents=True, exist_ok=True)
            p.rename(dest / p.name)
            moved = True
    return dest if moved else None

"""A heterogeneous-job executor built on submitit's own pieces.

submitit (1.5.4) writes one flat #SBATCH block and its watcher does not know het
component ids (`<id>+<k>`). We keep its PicklingExecutor (the DelayedSubmission pickle,
the submission-file bookkeeping), its Job (result pickles per task, `results()`,
`exception()`, `cancel()`), and replace what het jobs change: the script (one component
per role, hpc_rl.slurm.sbatch), the task count (every rank of every role), and the watcher
(component and step states per job id from sacct, squeue for what sacct does not list,
the batch shell's exit record once Slurm has forgotten the job; hpc_rl/slurm/states.py
reads them).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
import time as _time
import typing as tp
from pathlib import Path

from submitit.core import core as submitit_core
from submitit.core import utils as submitit_utils

from hpc_rl.config.schema import RunConfig
from hpc_rl.plan.job_plan import JobPlan
from hpc_rl.durable import write_atomic
from hpc_rl.rundir import RunDir
from hpc_rl.runtime import env
from hpc_rl.runtime.identity import role_offsets
from hpc_rl.runtime.signed_store import new_job_key
from hpc_rl.runtime.results import submitit_folder

from .sbatch import RenderOptions, job_name, render
from .states import (SACCT_FIELDS, SQUEUE_FORMAT, TERMINAL_BAD, JobIdentity, JobRecord, Row, aggregate_state, culprit, fitting,
                     fitting_of, parse_sacct_instances, parse_squeue, role_state)

__all__ = ["TERMINAL_BAD", "HetInfoWatcher", "HetJob", "HetSlurmExecutor", "job_from_run_dir", "aggregate_state",
           "sacct_records", "squeue_records"]

def sacct_records(ids: tp.List[str]) -> tp.Optional[tp.Dict[str, tp.List[JobRecord]]]:
    """Job id -> sacct's records of that id, oldest first (components and steps; -D: every job
    that had the id, see parse_sacct_instances); None when accounting does not answer
    (disabled, slurmdbd down)."""
    cmd = ["sacct", "-D", "-n", "-P", "-o", SACCT_FIELDS, "-j", ",".join(ids)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return parse_sacct_instances(proc.stdout) if proc.returncode == 0 else None


def squeue_records(ids: tp.List[str]) -> tp.Dict[str, JobRecord]:
    """Job id -> squeue's record (components only) for the ids squeue still lists."""
    # squeue exits 1 when one of the ids is unknown but still lists the others
    proc = subprocess.run(["squeue", "-t", "all", "-h", "-o", SQUEUE_FORMAT, "-j", ",".join(ids)],
                          capture_output=True, text=True, timeout=60)
    return parse_squeue(proc.stdout)


class HetInfoWatcher(submitit_core.InfoWatcher):
    """Per-component states of het jobs, per job id from the first source that knows it:
    sacct (steps included), squeue for what sacct does not list yet (a pending component is
    missing from sacct for seconds after submission), then the batch shell's exit record.
    Every update asks every source again: a sacct failure now says nothing about the next."""

    def __init__(self, delay_s: int = 5) -> None:
        super().__init__(delay_s)
        self.run_dirs: tp.Dict[str, Path] = {}
        self.identities: tp.Dict[str, JobIdentity] = {}
        self.sizes: tp.Dict[str, int] = {}  # job id -> number of components
        self.source = "none"  # the last update's sources (all jobs); per job: get_info(id)["source"]

    def register_job_of(self, job_id: str, run_dir: Path, identity: tp.Optional[JobIdentity], components: int) -> None:
        self.register_job(job_id)
        self.run_dirs[job_id] = Path(run_dir)
        if identity is not None:
            self.identities[job_id] = identity
        self.sizes[job_id] = components

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        return str(self.get_info(job_id, mode=mode).get("State") or "UNKNOWN")

    # the sources, as attributes so a test can stand in for an outage
    _sacct = staticmethod(sacct_records)
    _squeue = staticmethod(squeue_records)

    def exit_record(self, job_id: str) -> tp.Optional[dict]:
        """job_exit.json when the batch shell of this job (not an older one of the same id) wrote it."""
        run_dir = self.run_dirs.get(job_id)
        path = RunDir(run_dir).job_exit if run_dir else None
        if path is None or not path.exists():
            return None
        try:
            rec = json.loads(path.read_text())
            mtime = path.stat().st_mtime
        except (OSError, ValueError):
            return None
        ident = self.identities.get(job_id)
        if ident is not None and ident.submitted_after and mtime < ident.submitted_after:
            return None  # left by an earlier submission into this run directory
        return rec if str(rec.get("job_id")) == job_id else None

    def _merge(self, jid: str, sacct: tp.Optional[JobRecord], squeue: tp.Optional[JobRecord]) -> dict:
        """Per component: sacct's state where it lists the component, squeue's where not."""
        comps: tp.Dict[str, str] = {}
        sources = []
        if sacct is not None:
            comps.update(sacct.states())
            sources.append("sacct")
        if squeue is not None:
            missing = {cid: st for cid, st in squeue.states().items() if cid not in comps}
            if missing:
                comps.update(missing)
                sources.append("squeue")
        steps = sacct.steps if sacct is not None else {}
        return {"State": aggregate_state(comps.values()), "components": comps, "steps": steps, "source": "+".join(sources)}

    def _complete(self, jid: str, rec: tp.Optional[JobRecord]) -> bool:
        return rec is not None and len(rec.components) >= self.sizes.get(jid, 1)

    def update(self) -> None:
        ids = sorted(self._registered - self._finished)
        if not ids:
            return
        self._num_calls += 1
        try:
            by_sacct = self._sacct(ids)
        except (OSError, subprocess.TimeoutExpired):  # no sacct binary, or slurmdbd hangs
            by_sacct = None
        sacct_recs, notes = {}, {}
        for jid in ids:
            rec, why = fitting_of((by_sacct or {}).get(jid), self.identities.get(jid))
            if rec is not None:
                sacct_recs[jid] = rec
            elif why:
                notes[jid] = f"sacct's job {jid} is another job: {why}"
        ask_squeue = [jid for jid in ids if not self._complete(jid, sacct_recs.get(jid))]
        squeue_recs: tp.Dict[str, JobRecord] = {}
        if ask_squeue:
            try:
                by_squeue = self._squeue(ask_squeue)
            except (OSError, subprocess.TimeoutExpired) as exc:
                submitit_core.logger.get_logger().warning(f"cannot query squeue ({exc}); states may be stale")
                by_squeue = {}
            for jid in ask_squeue:
                rec, why = fitting(by_squeue.get(jid), self.identities.get(jid))
                if rec is not None:
                    squeue_recs[jid] = rec
                elif why:
                    notes[jid] = f"squeue's job {jid} is another job: {why}"
        sources = set()
        for jid in ids:
            if jid in sacct_recs or jid in squeue_recs:
                info = self._merge(jid, sacct_recs.get(jid), squeue_recs.get(jid))
            else:
                rec = self.exit_record(jid)
                if rec is not None:  # Slurm forgot the job (or never had accounting); the batch shell left its outcome
                    state = "COMPLETED" if int(rec.get("exit_code", 1)) == 0 else "REQUEUED" if rec.get("requeued") else "FAILED"
                    info = {"State": state, "components": {}, "steps": {}, "exit": rec, "source": "job_exit.json"}
                else:  # no source knows it (yet): say so, keep no stale state
                    info = {"State": "UNKNOWN", "components": {}, "steps": {}, "source": "none"}
            if jid in notes:
                info["other_job"] = notes[jid]
            sources.add(info["source"])
            self._info_dict[jid] = info  # type: ignore[assignment]
        self.source = ",".join(sorted(sources))
        self._last_status_check = _time.time()
        for jid in ids:
            # Done for good once accounting holds the whole job (or there is no accounting, or
            # only job_exit.json knows it): slurmdbd records a job's end after squeue shows it,
            # and its steps name the culprit, so a job squeue alone ended is asked again.
            settled = by_sacct is None or self._complete(jid, sacct_recs.get(jid)) or jid not in squeue_recs
            if settled and self.is_done(jid, mode="cache"):
                self._finished.add(jid)


class HetJob(submitit_core.Job[tp.Any]):
    """A submitit Job for a het job: task k is global rank k; roles map to task ranges."""

    _cancel_command = "scancel"
    watcher = HetInfoWatcher(delay_s=5)

    def __init__(self, folder: tp.Union[Path, str], job_id: str, tasks: tp.Sequence[int] = (0,)) -> None:
        super().__init__(folder, job_id, tasks)
        self.roles: tp.Dict[str, tp.Tuple[int, int]] = {}  # role -> (first task, tasks), set by the executor
        self.run_dir: tp.Optional[Path] = None
        self.identity: tp.Optional[JobIdentity] = None

    def attach(self, plan: JobPlan, run_dir: Path, identity: tp.Optional[JobIdentity] = None) -> "HetJob":
        self.roles = role_offsets(plan)
        self.run_dir = Path(run_dir)
        self.identity = identity
        self.watcher.register_job_of(self.job_id, self.run_dir, identity, len(self.roles))
        return self

    @property
    def component_ids(self) -> tp.List[str]:
        return [f"{self.job_id}+{k}" for k in range(len(self.roles))]

    @property
    def source(self) -> str:
        """Where the last state came from: sacct, squeue, sacct+squeue, job_exit.json or none."""
        return str(self.watcher.get_info(self.job_id, mode="cache").get("source") or "none")

    def _component_key(self, comps: tp.Mapping[str, tp.Any], k: int) -> str:
        cid = f"{self.job_id}+{k}"
        return self.job_id if cid not in comps and k == 0 and self.job_id in comps else cid

    def component_states(self, force: bool = False) -> tp.Dict[str, str]:
        """role -> its state: the component's allocation state, or its step's once the step has
        ended badly or the job has ended (sacct: one failing role reads FAILED, the roles the
        batch shell stopped CANCELLED); the role job_exit.json names as failed reads FAILED.
        Empty once Slurm has forgotten the job."""
        info = self.watcher.get_info(self.job_id, mode="force" if force else "standard")
        comps: tp.Dict[str, str] = info.get("components") or {}  # type: ignore[assignment]
        steps: tp.Dict[str, tp.List[Row]] = info.get("steps") or {}  # type: ignore[assignment]
        out = {}
        for k, role in enumerate(self.roles):
            key = self._component_key(comps, k)
            if key in comps:
                out[role] = role_state(comps[key], steps.get(key, []))
        failed = self._exit_failed_role()
        if failed in out and out[failed] not in TERMINAL_BAD and info.get("State") in TERMINAL_BAD:
            out[failed] = "FAILED"  # the batch shell's verdict is the source of truth
        return out

    def _exit_failed_role(self) -> tp.Optional[str]:
        rec = self.exit_record()
        role = rec.get("failed_role") if rec and int(rec.get("exit_code", 0)) != 0 else None
        return role if role in self.roles else None

    def failed_role(self) -> tp.Optional[str]:
        """The role that failed first: job_exit.json's when present, else read from sacct's steps."""
        role = self._exit_failed_role()
        if role is not None:
            return role
        info = self.watcher.get_info(self.job_id, mode="cache")
        comps = info.get("components") or {}
        steps: tp.Dict[str, tp.List[Row]] = info.get("steps") or {}  # type: ignore[assignment]
        return culprit({role: steps.get(self._component_key(comps, k), []) for k, role in enumerate(self.roles)})

    def exit_record(self) -> tp.Optional[dict]:
        return self.watcher.exit_record(self.job_id)

    def check_identity(self) -> tp.Tuple[tp.Optional[bool], str]:
        """(True, how) when Slurm's or the run directory's record of this id is this run's job,
        (False, why) when only another job of that id is known (ids come back after a cluster
        restart), (None, why) when nothing can tell."""
        info = self.watcher.get_info(self.job_id, mode="force")
        src = info.get("source") or "none"
        if info.get("other_job") and src in ("none", "job_exit.json"):
            return False, str(info["other_job"])
        if self.identity is None or not self.identity.checkable:
            return None, f"{RunDir.JOB_META} records no name and submit time (an older version submitted it): cannot tell"
        if src == "none":
            return None, f"neither Slurm nor {RunDir.JOB_EXIT} knows job {self.job_id} now"
        return True, f"{src}: job {self.job_id} is {self.identity.name!r}, submitted at {self.identity.submit or 'this run'}"

    def role_outcomes(self) -> tp.Dict[str, tp.List[tp.Tuple[str, tp.Any]]]:
        """role -> per-rank ("success", result) / ("error", traceback) / ("missing", None)."""
        out: tp.Dict[str, tp.List[tp.Tuple[str, tp.Any]]] = {}
        for role, (first, n) in self.roles.items():
            rows = []
            for task in range(first, first + n):
                path = submitit_utils.JobPaths(self.paths.folder, self.job_id, task).result_pickle
                rows.append(submitit_utils.pickle_load(path) if path.exists() else ("missing", None))
            out[role] = rows
        return out

    def failure(self) -> tp.Optional[str]:
        """The failed role and rank with its error line, or None. The role the batch shell saw
        fail first comes first: its peers' later errors (connection closed) are consequences."""
        rec = self.exit_record()
        outcomes = self.role_outcomes()
        first = self.failed_role()
        order = sorted(outcomes, key=lambda role: role != first)
        for role in order:
            rows = outcomes[role]
            for rank, (outcome, value) in enumerate(rows):
                if outcome == "error":
                    last = str(value).strip().splitlines()[-1] if value else "error"
                    return f"{role}:{rank}: {last}"
        if rec and int(rec.get("exit_code", 0)) != 0:
            return f"{rec.get('failed_role') or 'a role'} failed (exit {rec.get('exit_code')}): {rec.get('detail') or 'no error recorded'}"
        return None


class HetSlurmExecutor(submitit_core.PicklingExecutor):
    """Submits one het job per run; `submit(fn, *args)` runs fn on every rank."""

    job_class = HetJob

    def __init__(self, cfg: RunConfig, plan: JobPlan, run_dir: Path, python: str, overrides: tp.Sequence[str] = ()) -> None:
        super().__init__(submitit_folder(run_dir))
        self.cfg, self.plan, self.run_dir, self.python = cfg, plan, Path(run_dir), python
        self.overrides = tuple(overrides)
        self.last_script: tp.Optional[str] = None

    def _num_tasks(self) -> int:
        return sum(r.tasks for r in self.plan.roles)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        self.last_script = render(self.cfg, self.plan, RenderOptions(run_dir=str(self.run_dir), python=self.python,
                                                                     pickled=True, overrides=self.overrides))
        return self.last_script

    def _make_submission_command(self, submission_file_path: Path) -> tp.List[str]:
        return ["sbatch", "--parsable", str(submission_file_path)]

    def _submit_command(self, command: str) -> HetJob:
        """submitit's own (core.PicklingExecutor._submit_command), with one change: sbatch
        runs with the job's secret in its environment (HPC_RL_JOB_KEY; sbatch's default
        --export=ALL hands it to the batch shell and srun to every task). It is in no
        file: not the script, not the submission pickle (a function and its arguments)."""
        tmp_uuid = uuid.uuid4().hex
        path = submitit_utils.JobPaths.get_first_id_independent_folder(self.folder) / f".submission_file_{tmp_uuid}.sh"
        with path.open("w") as f:
            f.write(self._make_submission_file_text(command, tmp_uuid))
        sbatch_env = dict(os.environ, **{env.JOB_KEY: new_job_key()})
        output = submitit_utils.CommandFunction(self._make_submission_command(path), verbose=False, env=sbatch_env)()
        job_id = self._get_job_id_from_submission_command(output)
        job = self.job_class(folder=self.folder, job_id=job_id, tasks=list(range(self._num_tasks())))
        job.paths.move_temporary_file(path, "submission_file", keep_as_symlink=True)
        self._write_job_id(job.job_id, tmp_uuid)
        self._set_job_permissions(job.paths.folder)
        return job

    @staticmethod
    def _get_job_id_from_submission_command(string: tp.Union[bytes, str]) -> str:
        text = string.decode() if isinstance(string, bytes) else string
        job_id = text.strip().splitlines()[-1].split(";")[0].strip()
        if not job_id.isdigit():
            raise RuntimeError(f"could not read a job id from sbatch's answer: {text!r}")
        return job_id

    def submit_run(self, fn: tp.Callable[..., tp.Any], *args: tp.Any) -> HetJob:
        submitted_after = _time.time()
        job = self.submit(fn, *args)
        assert isinstance(job, HetJob)
        identity = JobIdentity(job.job_id, job_name(self.cfg), submit_time(job.job_id), submitted_after)
        job.attach(self.plan, self.run_dir, identity)
        # keep the script beside the run for users and requeues
        # job.json is how watch, pipelines and a reattached handle find this job: whole, durable
        if self.last_script is not None:
            write_atomic(RunDir(self.run_dir).job_script, self.last_script)
        write_atomic(RunDir(self.run_dir).job_meta, json.dumps({
            "job_id": job.job_id,
            "components": {role: f"{job.job_id}+{k}" for k, role in enumerate(job.roles)},
            "submitit_folder": str(self.folder),
            # what tells this job from another with the same id (ids restart with the controller)
            "job_name": identity.name,
            "submit_time": identity.submit,
            "submitted_after": identity.submitted_after,
        }, indent=2) + "\n")
        return job


def submit_time(job_id: str) -> str:
    """Slurm's submit time of a job just submitted ('' if squeue does not answer)."""
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%V"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = proc.stdout.split()
    return lines[0] if proc.returncode == 0 and lines else ""


def job_from_run_dir(run_dir: Path) -> HetJob:
    """Reattach to a submitted run (for watch/cancel commands in another process); its
    `check_identity()` says whether Slurm's job of that id is still this run's."""
    run_dir = Path(run_dir)
    meta = json.loads(RunDir(run_dir).job_meta.read_text())
    plan = JobPlan.from_dict(json.loads(RunDir(run_dir).plan.read_text()))
    tasks = range(sum(r.tasks for r in plan.roles))
    return HetJob(meta["submitit_folder"], str(meta["job_id"]), tasks=tasks).attach(plan, run_dir, JobIdentity.from_meta(meta))

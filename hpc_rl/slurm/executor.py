"""A heterogeneous-job executor built on submitit's own pieces.

submitit (1.5.4) writes one flat #SBATCH block and its watcher does not know het
component ids (`<id>+<k>`). We keep its PicklingExecutor (the DelayedSubmission pickle,
the submission-file bookkeeping), its Job (result pickles per task, `results()`,
`exception()`, `cancel()`), and replace what het jobs change: the script (one component
per role, hpc_rl.slurm.sbatch), the task count (every rank of every role), and the watcher
(component states from sacct, or from squeue when accounting is off, or from the batch
shell's exit record once Slurm has forgotten the job).
"""

from __future__ import annotations

import json
import subprocess
import time as _time
import typing as tp
from pathlib import Path

from submitit.core import core as submitit_core
from submitit.core import utils as submitit_utils

from hpc_rl.config.schema import RunConfig
from hpc_rl.plan.job_plan import JobPlan
from hpc_rl.rundir import RunDir
from hpc_rl.runtime.identity import role_offsets
from hpc_rl.runtime.results import submitit_folder

from .sbatch import RenderOptions, render

TERMINAL_BAD = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def aggregate_state(states: tp.Iterable[str]) -> str:
    """One state for a het job from its components' states."""
    states = [s.split()[0].upper() for s in states if s]
    if not states:
        return "UNKNOWN"
    for bad in TERMINAL_BAD:
        if bad in states:
            return bad
    if all(s == "COMPLETED" for s in states):
        return "COMPLETED"
    for s in ("RUNNING", "COMPLETING", "REQUEUED", "PENDING", "CONFIGURING"):
        if s in states:
            return s
    return states[0]


def leader_of(job_id: str) -> str:
    return job_id.split("+")[0].split("_")[0]


class HetInfoWatcher(submitit_core.InfoWatcher):
    """Per-component states of het jobs: sacct, else squeue, else the job's exit record."""

    def __init__(self, delay_s: int = 5) -> None:
        super().__init__(delay_s)
        self.sacct_ok: tp.Optional[bool] = None  # unknown until first tried
        self.run_dirs: tp.Dict[str, Path] = {}
        self.source = "none"

    def register_run_dir(self, job_id: str, run_dir: Path) -> None:
        self.run_dirs[job_id] = Path(run_dir)

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        return str(self.get_info(job_id, mode=mode).get("State") or "UNKNOWN")

    def _query(self, ids: tp.List[str]) -> tp.Dict[str, tp.Dict[str, str]]:
        """component id -> state, for the leaders in `ids`."""
        out: tp.Dict[str, tp.Dict[str, str]] = {}
        if self.sacct_ok is not False:
            cmd = ["sacct", "-X", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", ",".join(ids)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                self.sacct_ok, self.source = True, "sacct"
                for line in proc.stdout.splitlines():
                    parts = line.split("|")
                    if len(parts) >= 2 and parts[0]:
                        out.setdefault(leader_of(parts[0]), {})[parts[0]] = parts[1]
                return out
            self.sacct_ok = False  # accounting disabled ("accounting storage is disabled")
        proc = subprocess.run(["squeue", "-t", "all", "-h", "-o", "%i|%T", "-j", ",".join(ids)], capture_output=True, text=True)
        self.source = "squeue"
        for line in proc.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 2 and parts[0]:
                out.setdefault(leader_of(parts[0]), {})[parts[0]] = parts[1]
        return out

    def _exit_record(self, job_id: str) -> tp.Optional[dict]:
        run_dir = self.run_dirs.get(job_id)
        path = RunDir(run_dir).job_exit if run_dir else None
        if path is None or not path.exists():
            return None
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return rec if str(rec.get("job_id")) == job_id else None

    def update(self) -> None:
        ids = sorted(self._registered - self._finished)
        if not ids:
            return
        self._num_calls += 1
        try:
            found = self._query(ids)
        except OSError as exc:  # no squeue/sacct binaries at all
            submitit_core.logger.get_logger().warning(f"cannot query Slurm ({exc}); states may be stale")
            found = {}
        for jid in ids:
            comps = found.get(jid)
            if comps:
                self._info_dict[jid] = {"State": aggregate_state(comps.values()), "components": comps}  # type: ignore[dict-item]
                continue
            rec = self._exit_record(jid)
            if rec is not None:  # Slurm forgot the job; the batch shell left its outcome
                state = "COMPLETED" if int(rec.get("exit_code", 1)) == 0 else "FAILED"
                self._info_dict[jid] = {"State": state, "components": {}, "exit": rec}  # type: ignore[dict-item]
            else:  # neither Slurm nor the run directory knows it (yet): say so, keep no stale state
                self._info_dict[jid] = {"State": "UNKNOWN", "components": {}}  # type: ignore[dict-item]
        self._last_status_check = _time.time()
        for jid in ids:
            if self.is_done(jid, mode="cache"):
                self._finished.add(jid)


class HetJob(submitit_core.Job[tp.Any]):
    """A submitit Job for a het job: task k is global rank k; roles map to task ranges."""

    _cancel_command = "scancel"
    watcher = HetInfoWatcher(delay_s=5)

    def __init__(self, folder: tp.Union[Path, str], job_id: str, tasks: tp.Sequence[int] = (0,)) -> None:
        super().__init__(folder, job_id, tasks)
        self.roles: tp.Dict[str, tp.Tuple[int, int]] = {}  # role -> (first task, tasks), set by the executor
        self.run_dir: tp.Optional[Path] = None

    def attach(self, plan: JobPlan, run_dir: Path) -> "HetJob":
        self.roles = role_offsets(plan)
        self.run_dir = Path(run_dir)
        self.watcher.register_run_dir(self.job_id, self.run_dir)
        return self

    @property
    def component_ids(self) -> tp.List[str]:
        return [f"{self.job_id}+{k}" for k in range(len(self.roles))]

    def component_states(self, force: bool = False) -> tp.Dict[str, str]:
        """role -> Slurm state of its component (empty once Slurm has forgotten the job)."""
        info = self.watcher.get_info(self.job_id, mode="force" if force else "standard")
        comps = info.get("components") or {}
        out = {}
        for k, role in enumerate(self.roles):
            state = comps.get(f"{self.job_id}+{k}")  # type: ignore[union-attr]
            if state is None and k == 0:
                state = comps.get(self.job_id)  # type: ignore[union-attr]
            if state:
                out[role] = state
        return out

    def exit_record(self) -> tp.Optional[dict]:
        return self.watcher._exit_record(self.job_id)

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
        first = rec.get("failed_role") if rec else None
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

    @staticmethod
    def _get_job_id_from_submission_command(string: tp.Union[bytes, str]) -> str:
        text = string.decode() if isinstance(string, bytes) else string
        job_id = text.strip().splitlines()[-1].split(";")[0].strip()
        if not job_id.isdigit():
            raise RuntimeError(f"could not read a job id from sbatch's answer: {text!r}")
        return job_id

    def submit_run(self, fn: tp.Callable[..., tp.Any], *args: tp.Any) -> HetJob:
        job = self.submit(fn, *args)
        assert isinstance(job, HetJob)
        job.attach(self.plan, self.run_dir)
        # keep the script beside the run for users and requeues
        if self.last_script is not None:
            RunDir(self.run_dir).job_script.write_text(self.last_script)
        RunDir(self.run_dir).job_meta.write_text(json.dumps({
            "job_id": job.job_id,
            "components": {role: f"{job.job_id}+{k}" for k, role in enumerate(job.roles)},
            "submitit_folder": str(self.folder),
        }, indent=2) + "\n")
        return job


def job_from_run_dir(run_dir: Path) -> HetJob:
    """Reattach to a submitted run (for watch/cancel commands in another process)."""
    run_dir = Path(run_dir)
    meta = json.loads(RunDir(run_dir).job_meta.read_text())
    plan = JobPlan.from_dict(json.loads(RunDir(run_dir).plan.read_text()))
    tasks = range(sum(r.tasks for r in plan.roles))
    return HetJob(meta["submitit_folder"], meta["job_id"], tasks=tasks).attach(plan, run_dir)

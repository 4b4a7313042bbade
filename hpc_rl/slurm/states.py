"""What Slurm says about one het job, read from `sacct` (steps included) or `squeue`.

Pure functions over the commands' text, so the executor's watcher (slurm/executor.py) and
the tests share one reading:

- a job's components are `<id>+<k>` (a plain job is `<id>`); sacct also lists steps,
  `<id>+<k>.<step>` and `<id>+<k>.batch`;
- `sacct -X` shows every component FAILED when one role fails (the batch shell exits
  non-zero for the whole allocation); only the steps single out the culprit: its step is
  FAILED, the steps the batch shell stopped are CANCELLED. So a role's state is its
  component's last step's state once that step has ended badly or the allocation has ended;
- job ids come back (the local cluster restarts slurmctld with `-c`; ids also wrap on big
  clusters), and sacct keeps the older jobs: a record counts for a job only when its name
  and submit time fit the job the run directory recorded (`JobIdentity`).
"""

from __future__ import annotations

import time
import typing as tp
from dataclasses import asdict, dataclass, field

TERMINAL_BAD = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")
TERMINAL = ("COMPLETED", *TERMINAL_BAD)

# sacct and squeue print times in the client's local time, to the second.
SLURM_TIME = "%Y-%m-%dT%H:%M:%S"
# A submit time known only from this machine's clock (squeue did not answer right after
# sbatch) may differ from the controller's: a reused id is older than this by far.
CLOCK_SLACK_S = 300.0

# Reason last: a pending job's why (Resources, Dependency, DependencyNeverSatisfied)
SACCT_FIELDS = "JobID,JobName,State,ExitCode,Submit,End,Reason"
SQUEUE_FORMAT = "%i|%T|%j|%V|%r"


def first_word(state: str) -> str:
    """'CANCELLED by 0' -> 'CANCELLED'."""
    return state.split()[0].upper() if state and state.split() else ""


def aggregate_state(states: tp.Iterable[str]) -> str:
    """One state for a het job from its components' states."""
    states = [first_word(s) for s in states if s and s.split()]
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
    return job_id.split("+")[0].split("_")[0].split(".")[0]


def slurm_epoch(text: str) -> tp.Optional[float]:
    """'2026-12-01T13:20:00' (local time) -> epoch seconds; None for 'Unknown', 'None', ''."""
    try:
        return time.mktime(time.strptime(text.strip(), SLURM_TIME))
    except (ValueError, OverflowError):
        return None


@dataclass(frozen=True)
class JobIdentity:
    """What tells a job apart from another with the same id, recorded at submission."""

    job_id: str
    name: str = ""
    submit: str = ""  # Slurm's submit time, as squeue printed it right after sbatch
    submitted_after: float = 0.0  # this machine's clock just before sbatch

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: dict) -> "JobIdentity":
        return cls(str(meta["job_id"]), str(meta.get("job_name") or ""), str(meta.get("submit_time") or ""),
                   float(meta.get("submitted_after") or 0.0))

    @property
    def checkable(self) -> bool:
        return bool(self.name) and bool(self.submit or self.submitted_after)

    def earliest_submit(self) -> tp.Optional[float]:
        """No record of this job can be older than this (a requeue moves the submit time on)."""
        exact = slurm_epoch(self.submit) if self.submit else None
        if exact is not None:
            return exact
        return self.submitted_after - CLOCK_SLACK_S if self.submitted_after else None

    def mismatch(self, name: str, submit: str) -> tp.Optional[str]:
        """Why a record of this id is another job, or None when it fits (or cannot be checked)."""
        if self.name and name and name != self.name:
            return f"its name is {name!r}, this run's job is {self.name!r}"
        earliest, seen = self.earliest_submit(), slurm_epoch(submit)
        if earliest is not None and seen is not None and seen < earliest - 1:
            return f"it was submitted at {submit}, before this run's job ({self.submit or 'after ' + time.ctime(self.submitted_after)})"
        return None


@dataclass
class Row:
    job_id: str  # component id (`7+1`) or step id (`7+1.0`)
    state: str
    name: str = ""
    submit: str = ""
    exit_code: str = ""
    end: str = ""
    reason: str = ""  # Slurm's reason ("None" when there is none)


@dataclass
class JobRecord:
    """One source's view of one job: component allocations and (sacct only) their steps."""

    components: tp.Dict[str, Row] = field(default_factory=dict)
    steps: tp.Dict[str, tp.List[Row]] = field(default_factory=dict)  # component id -> its numbered steps

    def states(self) -> tp.Dict[str, str]:
        return {cid: first_word(row.state) for cid, row in self.components.items()}

    def reason(self) -> str:
        """The first component's Slurm reason that says something ("" when none does)."""
        return next((r.reason for r in self.components.values() if r.reason not in ("", "None", "(null)")), "")


def component_of(job_id: str) -> tp.Tuple[str, str]:
    """'7+1.0' -> ('7+1', '0'); '7+0.batch' -> ('7+0', 'batch'); '7+1' -> ('7+1', '')."""
    comp, _, step = job_id.partition(".")
    return comp, step


def parse_sacct_instances(text: str) -> tp.Dict[str, tp.List[JobRecord]]:
    """`sacct -D -n -P -o JobID,JobName,State,ExitCode,Submit,End` (steps included) -> leader ->
    its records, oldest first: one per submission of that id (older jobs that had the id, and
    each requeue of this one). Without -D sacct keeps the newest row *per component*, which
    mixes jobs: a new 4-component job 1 read with an old 5-component job 1's `1+4`. The
    components of one het job share their submit time; a step belongs to the component row
    printed last before it."""
    out: tp.Dict[str, tp.Dict[str, JobRecord]] = {}
    current: tp.Dict[str, JobRecord] = {}  # component id -> the record its latest row went to
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 6 or not parts[0]:
            continue
        jid, name, state, exit_code, submit, end = parts[:6]
        comp, step = component_of(jid)
        row = Row(jid, state, name, submit, exit_code, end, parts[6] if len(parts) > 6 else "")
        if not step:
            rec = out.setdefault(leader_of(comp), {}).setdefault(submit, JobRecord())
            rec.components[comp] = row
            current[comp] = rec
        elif step.isdigit() and comp in current:  # a role's srun; .batch and .extern are the shell's
            current[comp].steps.setdefault(comp, []).append(row)
    return {leader: [recs[k] for k in sorted(recs, key=lambda t: slurm_epoch(t) or 0.0)] for leader, recs in out.items()}


def parse_sacct(text: str) -> tp.Dict[str, JobRecord]:
    """leader -> its newest record (what a job id means now)."""
    return {leader: recs[-1] for leader, recs in parse_sacct_instances(text).items()}


def parse_squeue(text: str) -> tp.Dict[str, JobRecord]:
    """`squeue -h -o '%i|%T|%j|%V'` -> leader -> record (components only: squeue keeps no ended steps)."""
    out: tp.Dict[str, JobRecord] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 2 or not parts[0]:
            continue
        name = parts[2] if len(parts) > 2 else ""
        submit = parts[3] if len(parts) > 3 else ""
        reason = parts[4] if len(parts) > 4 else ""
        out.setdefault(leader_of(parts[0]), JobRecord()).components[parts[0]] = Row(parts[0], parts[1], name, submit,
                                                                                     reason=reason)
    return out


def fitting(rec: tp.Optional[JobRecord], identity: tp.Optional[JobIdentity]) -> tp.Tuple[tp.Optional[JobRecord], str]:
    """The record when it is this job's, else (None, why it is another job's)."""
    if rec is None or not rec.components:
        return None, ""
    if identity is None:
        return rec, ""
    for row in rec.components.values():
        why = identity.mismatch(row.name, row.submit)
        if why:
            return None, why
    return rec, ""


def fitting_of(recs: tp.Optional[tp.Sequence[JobRecord]],
               identity: tp.Optional[JobIdentity]) -> tp.Tuple[tp.Optional[JobRecord], str]:
    """The newest of one id's records that is this job's (a requeue's record is), else (None,
    why the newest is another job's)."""
    why = ""
    for rec in reversed(list(recs or ())):
        found, reason = fitting(rec, identity)
        if found is not None:
            return found, ""
        why = why or reason
    return None, why


def last_step(rows: tp.Sequence[Row]) -> tp.Optional[Row]:
    return max(rows, key=lambda r: int(component_of(r.job_id)[1])) if rows else None


def role_state(alloc_state: str, steps: tp.Sequence[Row]) -> str:
    """A role's state: its step's once that step ended badly or the allocation ended, else
    the allocation's (a role whose step completed while the others run is still RUNNING)."""
    alloc = first_word(alloc_state)
    step = last_step(steps)
    if step is None:
        return alloc
    s = first_word(step.state)
    if s in TERMINAL_BAD or alloc in TERMINAL:
        return s
    return alloc


def signal_of(exit_code: str) -> int:
    """sacct's ExitCode is '<code>:<signal>'."""
    try:
        return int(exit_code.split(":")[1])
    except (IndexError, ValueError):
        return 0


def culprit(role_steps: tp.Dict[str, tp.Sequence[Row]]) -> tp.Optional[str]:
    """The role whose step failed first, from step states alone (job_exit.json, when present,
    is the batch shell's verdict and wins over this): a step killed by a signal first, then
    the earliest ending FAILED step, then any other bad end that is not a cancellation."""
    ranked = []
    for order, (role, rows) in enumerate(role_steps.items()):
        step = last_step(rows)
        if step is None:
            continue
        s = first_word(step.state)
        if s == "FAILED" or (s in TERMINAL_BAD and s != "CANCELLED"):
            end = slurm_epoch(step.end)
            ranked.append((0 if signal_of(step.exit_code) else 1, 0 if s == "FAILED" else 1,
                           end if end is not None else float("inf"), order, role))
    return min(ranked)[-1] if ranked else None

"""RunDir: every path of a run directory, and the names the batch shell uses for them.

One directory per run holds everything the job side reads and writes:

  config.yaml, plan.json         the resolved config and the plan (ranks read these, never Hydra)
  logs/<role>.<restart>.out|err  per role and restart; logs/batch.out: the batch shell's own log
  errors/<role>.<rank>.<restart>.txt   a failed rank's traceback (first line: what happened)
  errors/dead_rank.<restart>.txt       heartbeats' verdict naming a dead or frozen rank
  errors/fatal.<restart>.txt           a failure no retry can fix: the batch shell does not requeue
  FINISHED                       the run is complete: never run (or requeued) again
  .save_request.<restart>        the batch shell's USR1 trap asks the ranks to save and stop
  release_stall                  a chaos drill ends an injected stall (runtime/faults.py)
  stopped.<restart>.json         the ranks saved and stopped on request: requeue, do not fail
  job_exit.json                  the batch shell's verdict (read when Slurm forgot the job)
  restarts.jsonl                 one line per resume
  timing/<role>.<rank>.<restart>.jsonl     per rank: its phase times, one line per training step
  timing/<role>.<rank>.<restart>.now.json  per rank: the phase it is in, since when (observe/timing.py)
  auth/<role>.<rank>.<restart>.json        per rank: values and messages it rejected, its MAC work
                                           (runtime/auth_stats.py; summed into summary.json)
  metrics.jsonl, rollouts.h5, progress.json, summary.json   the RL records (rl/records.py)
  tensorboard/, wandb/, mlruns/  the loggers of `logger` (observe/loggers.py); loggers.json: their run ids
  plots/                         PNGs of the metrics (observe/plots.py, `python -m hpc_rl.plot`)
  submitit/                      per-rank result pickles (and the executor's submission pickle)
  checkpoints/, final_hf/        trainer checkpoints and the exported Hugging Face model
  final_adapter/                 a LoRA student's PEFT adapter (trainer.lora)
  topology.<restart>.txt, placement.<restart>.json   `scontrol show topology`, the placement made of it
  job.sbatch, job.json           the submitted script and its job id (launcher=slurm)
  config_reads/                  which config keys each rank and the launch read (config/trace.py)
  data/train.jsonl               prompts generated from data.tasks

Modes: the directory and its subdirectories are 0700 (`run.dir_mode` may open them to the group,
never to writers other than the owner), and what the launch, the batch shell and the ranks
write there comes out under the matching umask: ranks unpickle and torch.load(weights_only=False)
files from it, so whoever can plant a file there runs code as the job.

A RunDir whose root and restart are shell words (`RunDir("$RUN_DIR")`, restart
"$HPC_RL_RESTART") renders the same names for the batch shell: `shell_lines` gives the
variable lines sbatch.py puts in every script, so no file name is written twice.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, List, Tuple, Union

from hpc_rl.durable import write_atomic

if TYPE_CHECKING:  # the plan layer may import this module: no import of it at run time
    from hpc_rl.config.schema import RunConfig
    from hpc_rl.plan.job_plan import JobPlan

Restart = Union[int, str]  # a number, or a shell word such as "$HPC_RL_RESTART"

# A role's name in file names: teacher/math -> teacher-math (file names cannot hold '/').
ROLE_SEP, ROLE_FILE_SEP = "/", "-"


def role_file_name(role: str) -> str:
    return role.replace(ROLE_SEP, ROLE_FILE_SEP)


def shell_role_file_name(var: str) -> str:
    """The same rule as bash parameter expansion of variable `var`: ${var//\\//-}."""
    return f"${{{var}//\\{ROLE_SEP}/{ROLE_FILE_SEP}}}"


DEFAULT_DIR_MODE = 0o700  # run.dir_mode's default, parsed (config/validate_rundir.py)


def umask_for(mode: int) -> int:
    """The umask under which new files and directories are no more open than `mode`."""
    return 0o777 & ~mode


@contextmanager
def private_umask(mode: int) -> Iterator[None]:
    """The process's umask is umask_for(mode) inside: what it writes into a run directory, and
    the children it starts (launcher=local's ranks; sbatch hands it on as SLURM_UMASK), come out
    no more open than the directory. The umask is per process: restored on the way out."""
    old = os.umask(umask_for(mode))
    try:
        yield
    finally:
        os.umask(old)


def make_dirs(path: Union[str, Path], mode: int = DEFAULT_DIR_MODE) -> Path:
    """`path` and its missing parents, each `mode` whatever the umask (mkdir's mode is masked by
    it); an existing `path` is set to `mode` too, so an old run directory is tightened on resume."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        os.makedirs(p, mode, exist_ok=True)  # exist_ok: made meanwhile by another launch
    for p in missing or [path]:
        os.chmod(p, mode)
    return path


class RunDir:
    CONFIG = "config.yaml"
    PLAN = "plan.json"
    LOGS = "logs"
    BATCH_LOG = "batch.out"
    ERRORS = "errors"
    FINISHED = "FINISHED"
    STALL_RELEASE = "release_stall"  # a drill that has seen what an injected stall waits for ends it
    JOB_EXIT = "job_exit.json"
    RESTARTS = "restarts.jsonl"
    METRICS = "metrics.jsonl"
    ROLLOUTS = "rollouts.h5"
    PROGRESS = "progress.json"
    SUMMARY = "summary.json"
    SUBMITIT = "submitit"
    CHECKPOINTS = "checkpoints"
    FINAL_HF = "final_hf"
    FINAL_ADAPTER = "final_adapter"  # a LoRA student's PEFT adapter directory (trainer.lora)
    JOB_SCRIPT = "job.sbatch"
    JOB_META = "job.json"
    TRAIN_DATA = "data/train.jsonl"
    CONFIG_READS = "config_reads"
    TIMING = "timing"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"  # W&B itself names the folder it makes in the directory it is given
    MLRUNS = "mlruns"
    LOGGERS = "loggers.json"
    PLOTS = "plots"
    # per restart: a requeued job must never read the last attempt's request or verdict
    LOG = "{role}.{restart}.{stream}"
    ERROR_REPORT = "{role}.{rank}.{restart}.txt"
    DEAD_RANK = "dead_rank.{restart}.txt"
    FATAL = "fatal.{restart}.txt"
    SAVE_REQUEST = ".save_request.{restart}"
    STOPPED = "stopped.{restart}.json"
    TOPOLOGY = "topology.{restart}.txt"
    PLACEMENT = "placement.{restart}.json"
    STEP_TIMING = "{role}.{rank}.{restart}.jsonl"
    PHASE_NOW_SUFFIX = ".now.json"
    PHASE_NOW = "{role}.{rank}.{restart}" + PHASE_NOW_SUFFIX
    AUTH = "auth"
    AUTH_REPORT = "{role}.{rank}.{restart}.json"

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    # ------------------------------------------------------------------ fixed names
    @property
    def config(self) -> Path:
        return self.path / self.CONFIG

    @property
    def plan(self) -> Path:
        return self.path / self.PLAN

    @property
    def logs(self) -> Path:
        return self.path / self.LOGS

    @property
    def batch_log(self) -> Path:
        return self.logs / self.BATCH_LOG

    @property
    def errors(self) -> Path:
        return self.path / self.ERRORS

    @property
    def finished(self) -> Path:
        return self.path / self.FINISHED

    @property
    def stall_release(self) -> Path:
        return self.path / self.STALL_RELEASE

    @property
    def job_exit(self) -> Path:
        return self.path / self.JOB_EXIT

    @property
    def restarts(self) -> Path:
        return self.path / self.RESTARTS

    @property
    def metrics(self) -> Path:
        return self.path / self.METRICS

    @property
    def rollouts(self) -> Path:
        return self.path / self.ROLLOUTS

    @property
    def progress(self) -> Path:
        return self.path / self.PROGRESS

    @property
    def summary(self) -> Path:
        return self.path / self.SUMMARY

    @property
    def submitit(self) -> Path:
        return self.path / self.SUBMITIT

    @property
    def checkpoints(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def final_hf(self) -> Path:
        return self.path / self.FINAL_HF

    @property
    def final_adapter(self) -> Path:
        return self.path / self.FINAL_ADAPTER

    @property
    def job_script(self) -> Path:
        return self.path / self.JOB_SCRIPT

    @property
    def job_meta(self) -> Path:
        return self.path / self.JOB_META

    @property
    def train_data(self) -> Path:
        return self.path / self.TRAIN_DATA

    @property
    def config_reads(self) -> Path:
        return self.path / self.CONFIG_READS

    @property
    def timing(self) -> Path:
        return self.path / self.TIMING

    @property
    def tensorboard(self) -> Path:
        return self.path / self.TENSORBOARD

    @property
    def wandb(self) -> Path:
        return self.path / self.WANDB

    @property
    def mlruns(self) -> Path:
        return self.path / self.MLRUNS

    @property
    def loggers(self) -> Path:
        return self.path / self.LOGGERS

    @property
    def plots(self) -> Path:
        return self.path / self.PLOTS

    # ------------------------------------------------------------------ per restart
    def log(self, role: str, restart: Restart, stream: str) -> Path:
        """stream: out | err."""
        return self.logs / self.LOG.format(role=role_file_name(role), restart=restart, stream=stream)

    def error_report(self, role: str, rank, restart: Restart) -> Path:
        return self.errors / self.ERROR_REPORT.format(role=role_file_name(role), rank=rank, restart=restart)

    def dead_rank(self, restart: Restart) -> Path:
        return self.errors / self.DEAD_RANK.format(restart=restart)

    def fatal(self, restart: Restart) -> Path:
        return self.errors / self.FATAL.format(restart=restart)

    def save_request(self, restart: Restart) -> Path:
        return self.path / self.SAVE_REQUEST.format(restart=restart)

    def stopped(self, restart: Restart) -> Path:
        return self.path / self.STOPPED.format(restart=restart)

    def topology(self, restart: Restart) -> Path:
        return self.path / self.TOPOLOGY.format(restart=restart)

    def placement(self, restart: Restart) -> Path:
        return self.path / self.PLACEMENT.format(restart=restart)

    def step_timing(self, role: str, rank, restart: Restart) -> Path:
        return self.timing / self.STEP_TIMING.format(role=role_file_name(role), rank=rank, restart=restart)

    def phase_now(self, role: str, rank, restart: Restart) -> Path:
        return self.timing / self.PHASE_NOW.format(role=role_file_name(role), rank=rank, restart=restart)

    def auth_report(self, role: str, rank, restart: Restart) -> Path:
        return self.path / self.AUTH / self.AUTH_REPORT.format(role=role_file_name(role), rank=rank, restart=restart)

    # ------------------------------------------------------------------ the batch shell
    def shell_vars(self, restart: str) -> List[Tuple[str, Path]]:
        """(bash variable, path) for what the batch shell reads and writes; this RunDir's root
        and `restart` are shell words, e.g. RunDir("$RUN_DIR").shell_vars("$HPC_RL_RESTART")."""
        return [
            ("PLAN_FILE", self.plan),
            ("FINISHED_FILE", self.finished),
            ("LOG_DIR", self.logs),
            ("TOPOLOGY_FILE", self.topology(restart)),
            ("SAVE_REQUEST_FILE", self.save_request(restart)),
            ("STOPPED_FILE", self.stopped(restart)),
            ("DEAD_RANK_FILE", self.dead_rank(restart)),
            ("FATAL_FILE", self.fatal(restart)),
            ("JOB_EXIT_FILE", self.job_exit),
        ]

    def shell_lines(self, restart: str) -> List[str]:
        return [f'{name}="{path}"' for name, path in self.shell_vars(restart)]

    # ------------------------------------------------------------------ creation
    @staticmethod
    def choose(cfg: "RunConfig") -> Path:
        """run.dir, else a new directory <run.root_dir>/<name>-<time> (never an existing one)."""
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

    @staticmethod
    def mode(cfg: "RunConfig") -> int:
        """run.dir_mode as a number (validation refused what does not parse)."""
        from hpc_rl.config.validate_rundir import parse_dir_mode

        return parse_dir_mode(cfg.run.dir_mode)

    @classmethod
    def create(cls, cfg: "RunConfig", plan: "JobPlan") -> "RunDir":
        """Make the directory (run.dir_mode, also when it exists) and write config.yaml and
        plan.json into it."""
        from hpc_rl.config.convert import to_yaml

        rd = cls(cls.choose(cfg).resolve())
        mode = cls.mode(cfg)
        make_dirs(rd.path, mode)
        make_dirs(rd.logs, mode)
        write_atomic(rd.config, to_yaml(cfg))
        write_atomic(rd.plan, plan.to_json())
        return rd


def choose_run_dir(cfg: "RunConfig") -> Path:
    return RunDir.choose(cfg)


def prepare_run_dir(cfg: "RunConfig", plan: "JobPlan") -> Path:
    return RunDir.create(cfg, plan).path

"""The experiment loggers of `logger`: metrics.jsonl plus TensorBoard, W&B and MLflow.

Trainer rank 0 (the driver) alone opens a `MetricsSink` (rl/loop.py) and appends every
record `MetricsLog` gets; the sink writes the record to metrics.jsonl unchanged and hands
each backend the flattened names (observe/metrics.py) on the record's step axis, so a
metric has one name and one step everywhere.

Backends are registered in LOGGERS by the name `logger` lists; each imports its package
only when opened, so a run without them never imports them. Where each writes:

  tensorboard  logging.tensorboard_dir, default <run dir>/tensorboard (torch's SummaryWriter)
  wandb        <run dir>/wandb/, offline by default (`wandb sync` uploads it), or online
  mlflow       logging.mlflow_tracking_uri, default a file store in <run dir>/mlruns

Credentials are never config keys: W&B and MLflow read theirs from the environment
(WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, ...) themselves, and nothing here prints or stores
environment variables.

A resumed run (requeue, restart in the same directory) continues the same runs: W&B and
MLflow by the ids kept in <run dir>/loggers.json; TensorBoard by purging the events of the
steps the run recomputes (SummaryWriter's purge_step). MLflow keeps a second value of a
recomputed step (its history is append-only). W&B takes increasing steps only: online it
ignores the recomputed steps (the first attempt's values stay); offline each attempt is an
offline-run-* folder of the same run id, which `wandb sync` uploads in order.

A backend failing while the run goes on (a W&B server unreachable in online mode) is
logged and dropped for the rest of the run: metrics.jsonl stays complete and the training
is not lost for a dashboard. Opening a backend fails loudly: that is a setting to fix.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Protocol, Tuple

from hpc_rl.durable import write_atomic
from hpc_rl.rundir import RunDir

from .metrics import flatten

ALWAYS = "jsonl"  # metrics.jsonl: the run's own record, which resume and summary.json read


class Backend(Protocol):
    def where(self) -> str: ...  # for the driver's log: where the metrics go (never a credential)

    def log(self, step: int, metrics: Dict[str, float]) -> None: ...

    def close(self, finished: bool) -> None: ...


@dataclass
class Opening:
    """What a backend is opened with."""

    run_dir: Path
    settings: Any  # the config's `logging` section (schema.LoggingConfig)
    run_name: str
    resumed_from: int  # the step the run resumes after (0: a fresh start)
    state: Dict[str, Any] = field(default_factory=dict)  # loggers.json: ids of earlier attempts' runs

    def config(self) -> Dict[str, Any]:
        """The resolved config as the ranks read it (config.yaml), for W&B's config and
        MLflow's artifacts. It holds no secret: the schema has no key for one."""
        import yaml

        path = RunDir(self.run_dir).config
        return yaml.safe_load(path.read_text()) if path.exists() else {}


class TensorBoardLogger:
    package = "tensorboard"

    def __init__(self, o: Opening):
        from torch.utils.tensorboard import SummaryWriter

        # this run's own event files: the purge below would hide another run's in a shared one
        self.dir = Path(o.settings.tensorboard_dir or RunDir(o.run_dir).tensorboard)
        # TensorBoard drops events at or after purge_step that earlier files hold: the steps
        # a resumed run recomputes (all of them, with the start evaluation, from step 0).
        purge = o.resumed_from + 1 if o.resumed_from else 0
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=purge)

    def where(self) -> str:
        return str(self.dir)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()  # a step is seconds to minutes: followers see it at once

    def close(self, finished: bool) -> None:
        self.writer.close()


class WandbLogger:
    package = "wandb"

    def __init__(self, o: Opening):
        import wandb

        s = o.settings
        saved = o.state.get("wandb") or {}
        run_id = saved.get("id") or uuid.uuid4().hex[:16]  # W&B ids: lowercase letters and digits
        self.mode = s.wandb_mode
        # console="off": the driver's log already goes to logs/trainer.0.*; W&B's capture of
        # it would be a second copy in the run directory (and on the server).
        self.run = wandb.init(project=s.wandb_project, entity=s.wandb_entity, name=o.run_name, id=run_id,
                              resume="allow", dir=str(o.run_dir), mode=self.mode, config=o.config(),
                              settings=wandb.Settings(console="off"))
        o.state["wandb"] = {"id": run_id, "project": s.wandb_project}

    def where(self) -> str:
        return f"{self.mode} run {self.run.id} in project {self.run.project} ({self.run.dir})"

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, finished: bool) -> None:
        import wandb

        self.run.finish()  # a stop for a requeue too: the next attempt resumes this run by its id
        wandb.teardown()  # ends W&B's service process, which would otherwise outlive the run's work


def _is_file_store(uri: str) -> bool:
    from urllib.parse import urlparse

    return urlparse(uri).scheme in ("", "file")


class MlflowLogger:
    package = "mlflow"

    def __init__(self, o: Opening):
        s = o.settings
        self.uri = s.mlflow_tracking_uri or RunDir(o.run_dir).mlruns.resolve().as_uri()
        if _is_file_store(self.uri):
            # MLflow 3 refuses its file store unless told it is meant: it is what runs with no
            # tracking server (this machine's tests, a cluster without one) use.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        saved = o.state.get("mlflow") or {}
        if saved.get("tracking_uri") == self.uri:
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(s.mlflow_experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(s.mlflow_experiment)
            self.run_id = self.client.create_run(exp_id, run_name=o.run_name).info.run_id
            config = RunDir(o.run_dir).config
            if config.exists():
                self.client.log_artifact(self.run_id, str(config))
        o.state["mlflow"] = {"tracking_uri": self.uri, "run_id": self.run_id}

    def where(self) -> str:
        return f"run {self.run_id} at {self.uri}"

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v in metrics.items()])

    def close(self, finished: bool) -> None:
        # KILLED: this attempt stopped (a requeue continues the run and sets it RUNNING again)
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


# name in `logger` -> backend; "jsonl" is the sink's own file and always on
LOGGERS: Dict[str, Callable[[Opening], Backend]] = {
    "tensorboard": TensorBoardLogger,
    "wandb": WandbLogger,
    "mlflow": MlflowLogger,
}


def names() -> List[str]:
    return [ALWAYS, *LOGGERS]


def missing_packages(logger: List[str]) -> List[Tuple[str, str]]:
    """(logger, package) for each logger whose package this Python cannot import: refused
    before launch (rl/inputs.py) rather than by the driver after every model has loaded."""
    pkgs = [(name, getattr(LOGGERS.get(name), "package", None)) for name in logger]
    return [(name, pkg) for name, pkg in pkgs if pkg and importlib.util.find_spec(pkg) is None]


class MetricsSink:
    """What the driver appends records to: metrics.jsonl, then every open backend."""

    def __init__(self, jsonl, backends: Mapping[str, Backend], run_dir: Path, log: logging.Logger):
        self.jsonl, self.backends = jsonl, dict(backends)
        self.run_dir, self.log = Path(run_dir), log

    def append(self, record: Mapping[str, Any]) -> None:
        self.jsonl.append(record)
        step, flat = flatten(record)
        for name, backend in list(self.backends.items()):
            try:
                backend.log(step, flat)
            except Exception as exc:  # noqa: BLE001 (see the module docstring: the run goes on)
                self.log.warning("logger %s failed at step %d and is off for the rest of the run "
                                 "(metrics.jsonl has every record): %s: %s", name, step, type(exc).__name__, exc)
                del self.backends[name]

    def close(self, finished: bool = False) -> None:
        """finished: the run is complete; also draw the plots (observe/plots.py). Never raises:
        a finished run stays finished whatever a dashboard or matplotlib does."""
        for name, backend in self.backends.items():
            try:
                backend.close(finished)
            except Exception as exc:  # noqa: BLE001
                self.log.warning("logger %s did not close cleanly: %s: %s", name, type(exc).__name__, exc)
        self.backends = {}
        if finished:
            self._plots()

    def _plots(self) -> None:
        try:
            from .plots import write_plots

            paths = write_plots(self.run_dir)
        except ImportError as exc:
            self.log.info("no plots: %s (pip install -e '.[observe]' adds matplotlib)", exc)
        except Exception as exc:  # noqa: BLE001
            self.log.warning("plots failed (the run is complete; `python -m hpc_rl.plot %s` retries): %s: %s",
                             self.run_dir, type(exc).__name__, exc)
        else:
            self.log.info("plots: %d PNGs in %s", len(paths), RunDir(self.run_dir).plots)


def open_sink(cfg, run_dir: Path, jsonl, resumed_from: int, log: logging.Logger) -> MetricsSink:
    """The driver's sink for `cfg.logger`; `jsonl` is the run's MetricsLog. Backends of an
    earlier attempt of this run directory are continued (loggers.json)."""
    rd = RunDir(run_dir)
    state: Dict[str, Any] = json.loads(rd.loggers.read_text()) if rd.loggers.exists() else {}
    o = Opening(Path(run_dir), cfg.logging, Path(run_dir).name, resumed_from, state)
    backends: Dict[str, Backend] = {}
    for name in dict.fromkeys(cfg.logger):  # in order, once each
        if name in LOGGERS:
            backends[name] = LOGGERS[name](o)
            log.info("logger %s: %s", name, backends[name].where())
    if state:
        write_atomic(rd.loggers, json.dumps(state, indent=2, sort_keys=True) + "\n")
    return MetricsSink(jsonl, backends, run_dir, log)

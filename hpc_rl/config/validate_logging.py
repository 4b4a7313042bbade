"""Validation of the experiment loggers (`logger`, `logging.*`): known names, no setting of
a logger that is off (nothing would read it), no credentials in a tracking URI."""

from __future__ import annotations

import dataclasses
from typing import List
from urllib.parse import urlsplit

from .errors import Violation
from .schema import LOGGER_NAMES, LoggingConfig, RunConfig

# logging.<prefix>_* settings belong to the logger of that name (schema.LoggingConfig)
_LOGGING_OWNER = {"tensorboard_": "tensorboard", "wandb_": "wandb", "mlflow_": "mlflow"}
_HIDDEN = "<hidden: it holds credentials>"


def check_logging(out: List[Violation], cfg: RunConfig) -> None:
    known = list(LOGGER_NAMES)
    for i, name in enumerate(cfg.logger):
        if name not in known:
            out.append(Violation(f"logger[{i}]", name, f"unknown logger (jsonl is always on; known: {known})",
                                 f"choose from {known}, e.g. logger=[jsonl,tensorboard]"))
    uri = cfg.logging.mlflow_tracking_uri
    # a URI is written to config.yaml, the logs and the MLflow run: credentials in it would leak
    # (and no violation shows them either)
    leaky = bool(uri) and "@" in (urlsplit(uri).netloc or "")
    # A setting of a logger that is off would be ignored: refused, like any key nothing reads.
    for f in dataclasses.fields(LoggingConfig):
        owner = next(o for p, o in _LOGGING_OWNER.items() if f.name.startswith(p))
        value = getattr(cfg.logging, f.name)
        if owner not in cfg.logger and value != f.default:
            out.append(Violation(f"logging.{f.name}", _HIDDEN if leaky and value == uri else value,
                                 f"set, but the {owner} logger is off, so nothing reads it",
                                 f"add {owner} to logger (e.g. logger=[jsonl,{owner}]) or remove logging.{f.name}"))
    if leaky:
        out.append(Violation("logging.mlflow_tracking_uri", _HIDDEN,
                             "credentials in the URI would be written to config.yaml and the logs",
                             "remove user:password@ from the URI; MLflow reads MLFLOW_TRACKING_USERNAME/"
                             "MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN from the environment"))

"""Hydra composition: command-line overrides + recipes/ -> a validated RunConfig.

The schema's defaults are registered in Hydra's ConfigStore as the base of every config,
so every schema key exists before the YAML files and overrides land (`trainer.nodes=32`
works on any recipe). Hydra's struct checks are not used for unknown keys: our converter
lists all of them at once, with suggestions.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from .convert import to_typed, to_yaml  # noqa: F401 (hpc_rl.config exports to_yaml from here)
from .errors import ConfigError, Violation
from .schema import RunConfig
from .validate import validate

SCHEMA_NODE = "hpc_rl_schema"


def recipes_dir() -> Path:
    """The Hydra config tree: $HPC_RL_RECIPES, else recipes/ beside the package."""
    env = os.environ.get("HPC_RL_RECIPES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "recipes"


def available(group: str) -> List[str]:
    return sorted(p.stem for p in (recipes_dir() / group).glob("*.yaml"))


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    # A plain mapping, not the dataclass: a structured node would make OmegaConf reject the
    # first unknown key on its own terms; validation reports them all instead.
    ConfigStore.instance().store(name=SCHEMA_NODE, node=dataclasses.asdict(RunConfig()))


def compose_raw(overrides: Sequence[str]) -> Tuple[DictConfig, Optional[str]]:
    """Compose the config tree with Hydra; returns the config and the chosen recipe."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None, job_name="hpc_rl"):
            cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError([_hydra_violation(exc, overrides)]) from None
    finally:
        GlobalHydra.instance().clear()
    recipe = cfg.hydra.runtime.choices.get("recipe")
    # Hydra's own node holds interpolations that only resolve inside a Hydra app; drop it.
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, recipe


def _hydra_violation(exc: Exception, overrides: Sequence[str]) -> Violation:
    """Hydra's composition errors, reworded with the fix users most often need."""
    msg = str(exc).strip().splitlines()[0]
    if "recipe" in msg and ("Could not find" in msg or "not found" in msg):
        return Violation("recipe", [o for o in overrides if "recipe" in o], msg, f"choose one of {available('recipe')}")
    for group in ("cluster", "launcher", "model"):
        if f"'{group}/" in msg or f"'{group}'" in msg:
            return Violation(group, [o for o in overrides if o.lstrip("+~").startswith(group)], msg,
                             f"choose one of {available(group)}")
    bad = re.search(r"Could not override '([^']+)'", msg)
    if bad:
        key = bad.group(1)
        close = difflib.get_close_matches(key, _schema_keys(), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        value = next((o.split("=", 1)[-1] for o in overrides if o.split("=", 1)[0] == key), None)
        return Violation(key, value, "no such key in the config",
                         f"{hint}--show-config lists every key; +{key}=... adds a new one where a mapping allows it")
    return Violation("override", list(overrides), msg, "see the Hydra override grammar: key=value, +key=value, group=option")


def _schema_keys() -> List[str]:
    out: List[str] = []

    def walk(prefix: str, node) -> None:
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else k
            out.append(key)
            if isinstance(v, dict):
                walk(key, v)

    walk("", dataclasses.asdict(RunConfig()))
    return out


def load_config(overrides: Sequence[str]) -> RunConfig:
    """Compose, type-check and validate; raises ConfigError listing every violation."""
    raw, recipe = compose_raw(overrides)
    try:
        data = OmegaConf.to_container(raw, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "interpolation"
        raise ConfigError([Violation(str(key), None, str(exc).splitlines()[0], "fix the ${...} interpolation it names")]) from None
    data["recipe"] = recipe
    if recipe is None:
        # Without a recipe the defaults describe no job; other complaints would be noise.
        raise ConfigError([Violation("recipe", None, "no recipe chosen", f"add +recipe=NAME, one of {available('recipe')}")])
    cfg, violations = to_typed(RunConfig, data)
    # Cross-field rules run on a config whose values all converted: a field that failed its
    # type check keeps its default, and rules over it would report confusing follow-ons.
    if all(v.problem == "unknown key" for v in violations):
        violations += validate(cfg)
    if violations:
        raise ConfigError(violations)
    return cfg

"""Compose and check every stage of a pipeline before anything is submitted.

Each stage is composed exactly as `python -m hpc_rl.launch +recipe=R ...` composes a run
(config/compose.py), then checked as that launch would check it (launch.check_runnable, the
launcher's preflight). Every violation of every stage is collected and raised at once,
keyed `stages.<stage>.<key>` so the fix is a command-line override.

`${stage:NAME}` is an OmegaConf resolver registered here. Checking resolves it to the
producer's export when that exists; before the producer has run it resolves to the
producer's own input model: the trainer exports the model it trains, so the export has that
model's architecture and shapes, and the consumer's checks (checkpoint loadable, tokenizer,
resumable checkpoints of the same shape) run against the shape it will get. Submission
resolves it to the export path itself (<pipeline dir>/<stage>/final_hf).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from hpc_rl.config.errors import ConfigError, Violation
from hpc_rl.config.schema import RunConfig
from hpc_rl.plan.job_plan import JobPlan
from hpc_rl.rundir import RunDir

from .spec import STAGE_REF, CommandLine, PipelineSpec

# The launchers a pipeline can use: stages chained by Slurm dependencies, or planned only.
PIPELINE_LAUNCHERS = ("slurm", "dry_run")
_resolve: Optional[Callable[[str], str]] = None


def _stage_resolver(name: str) -> str:
    if _resolve is None:
        raise ValueError(f"${{stage:{name}}} only resolves inside a pipeline (python -m hpc_rl.launch +pipeline=NAME)")
    return _resolve(str(name))


OmegaConf.register_new_resolver("stage", _stage_resolver, replace=True)


def stage_dir(pdir: Path, name: str) -> Path:
    return Path(pdir) / name


def export_path(pdir: Path, name: str) -> Path:
    """What `${stage:NAME}` names: the stage's final Hugging Face export (rundir.py's name)."""
    return RunDir(stage_dir(pdir, name)).final_hf


def export_ready(pdir: Path, name: str) -> bool:
    return RunDir(stage_dir(pdir, name)).finished.exists() and (export_path(pdir, name) / "config.json").is_file()


@dataclass
class StageCheck:
    """One stage, composed and checked."""

    name: str
    overrides: List[str]  # what composes it, `${stage:...}` unresolved (pipeline.json records these)
    cfg: Optional[RunConfig] = None  # the config it runs with (stage references: the exports' paths)
    checked: Optional[RunConfig] = None  # the same, stage references as checking resolves them (models resolved)
    plan: Optional[JobPlan] = None
    inputs: Dict[str, str] = field(default_factory=dict)  # config key -> producing stage


def stage_overrides(spec: PipelineSpec, cli: CommandLine, name: str, pdir: Path) -> List[str]:
    s = spec.stages[name]
    # The job name first, so a recipe or the command line may still set its own.
    return [f"+recipe={s.recipe}", f"launcher.slurm.job_name=hpc_rl-{spec.name}-{name}", *spec.overrides, *s.overrides,
            *cli.common, *cli.per_stage.get(name, []), f"run.dir={stage_dir(pdir, name).resolve()}"]


def compose_stage(overrides: List[str], resolve: Callable[[str], str]) -> RunConfig:
    global _resolve
    from hpc_rl.config import load_config

    _resolve = resolve
    try:
        return load_config(overrides)
    finally:
        _resolve = None


def _prefixed(name: str, violations: List[Violation]) -> List[Violation]:
    return [Violation(f"stages.{name}.{v.key}", v.value, v.problem, v.fix) for v in violations]


def _input_keys(overrides: List[str]) -> Dict[str, str]:
    """config key -> producing stage, for overrides like model.path=${stage:rlvr}."""
    out = {}
    for o in overrides:
        key, _, value = o.partition("=")
        for ref in STAGE_REF.findall(value):
            out[key.lstrip("+~")] = ref
    return out


def _cli_problems(cli: CommandLine, spec: PipelineSpec) -> List[Violation]:
    out = [Violation(f"stages.{s}", overs, "names no stage of this pipeline", f"use one of {sorted(spec.stages)}")
           for s, overs in cli.per_stage.items() if s not in spec.stages]
    for o in [*cli.common, *(x for v in cli.per_stage.values() for x in v)]:
        if o.split("=", 1)[0].lstrip("+~") == "run.dir":
            out.append(Violation("run.dir", o.split("=", 1)[-1], "each stage runs in <pipeline dir>/<stage>",
                                 "set pipeline.dir=DIR for the whole pipeline"))
        if o.split("=", 1)[0].lstrip("+~") == "launcher.slurm.dependency":
            out.append(Violation("launcher.slurm.dependency", o.split("=", 1)[-1],
                                 "the pipeline sets each stage's dependencies from its DAG", "remove it; use after: in the pipeline file"))
    return out


def check_all(spec: PipelineSpec, cli: CommandLine, pdir: Path, launcher_checks: bool = True) -> List[StageCheck]:
    """Compose and check every stage; raise one ConfigError listing every violation of every
    stage. `launcher_checks`: run what `python -m hpc_rl.launch` runs before it submits
    (models, data, support rules, the live cluster) for launchers that start ranks."""
    from hpc_rl.launchers.runnable import check_runnable
    from hpc_rl.launchers.base import LAUNCHERS
    from hpc_rl.plan import build_plan

    problems = spec.check() + _cli_problems(cli, spec)
    if problems:
        raise ConfigError(problems)
    shape_source: Dict[str, str] = {}  # stage -> the model its export will be shaped like
    checks: List[StageCheck] = []

    def resolve_for_check(ref: str) -> str:
        if export_ready(pdir, ref):
            return str(export_path(pdir, ref))
        if ref not in shape_source:
            raise ValueError(f"stage {ref!r} could not be composed, so its output cannot be checked")
        return shape_source[ref]

    for name in spec.order():
        overrides = stage_overrides(spec, cli, name, pdir)
        check = StageCheck(name, overrides, inputs=_input_keys(overrides))
        checks.append(check)
        try:
            # Twice: with the exports' paths (the config and plan it runs with: two teachers read
            # from two stages stay two groups) and with what checking can read today.
            cfg = compose_stage(overrides, lambda ref: str(export_path(pdir, ref)))
            checked = compose_stage(overrides, resolve_for_check)
        except ConfigError as err:
            problems += _prefixed(name, err.violations)
            continue
        if cfg.launcher.name not in PIPELINE_LAUNCHERS:
            problems.append(Violation(f"stages.{name}.launcher.name", cfg.launcher.name,
                                      "pipeline stages are Slurm jobs chained by dependencies",
                                      "launcher=slurm submits the pipeline, launcher=dry_run checks and plans it"))
        for key, producer in check.inputs.items():
            made = next((c for c in checks if c.name == producer), None)
            if made is not None and made.cfg is not None and not made.cfg.checkpoint.export_final:
                problems.append(Violation(f"stages.{name}.{key}", f"${{stage:{producer}}}",
                                          f"stage {producer} exports no checkpoint (checkpoint.export_final=false)",
                                          f"set stages.{producer}.checkpoint.export_final=true"))
        plan = build_plan(cfg)
        launcher = LAUNCHERS.get(cfg.launcher.name)
        if launcher_checks and launcher is not None and launcher.name in PIPELINE_LAUNCHERS:
            try:
                if launcher.starts_ranks:
                    checked, _ = check_runnable(checked)
                launcher.preflight(cfg, plan)
            except ConfigError as err:
                problems += _prefixed(name, err.violations)
        check.cfg, check.checked, check.plan = cfg, checked, plan
        if checked.model.path:
            shape_source[name] = checked.model.path
    if problems:
        raise ConfigError(problems)
    return checks


def submit_config(check: StageCheck, pdir: Path) -> Tuple[RunConfig, List[str]]:
    """The config a stage runs with: stage references are the producers' export paths; other
    model references are the checked ones (tiny:<name> resolved to its directory). Returns it
    with the overrides, references resolved (what a hand-submitted script replays)."""
    assert check.cfg is not None and check.checked is not None
    cfg, checked = check.cfg, check.checked
    exports = {str(export_path(pdir, ref)) for ref in check.inputs.values()}
    if cfg.model.path not in exports:
        cfg.model.path = checked.model.path
    for alias, t in cfg.teachers.items():
        if t.checkpoint not in exports and alias in checked.teachers:
            t.checkpoint = checked.teachers[alias].checkpoint
    return cfg, resolved_overrides(check.overrides, pdir)


def resolved_overrides(overrides: List[str], pdir: Path) -> List[str]:
    return [STAGE_REF.sub(lambda m: str(export_path(pdir, m.group(1))), o) for o in overrides]

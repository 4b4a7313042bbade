"""A pipeline: named stages, each one of today's het jobs composed from a recipe, joined
by the checkpoints they hand on.

recipes/pipeline/<name>.yaml:

  name: tiny_pipeline
  dir: runs/tiny_pipeline            # the pipeline directory (pipeline.dir=... on the command line)
  overrides: [cluster=local_slurm]   # applied to every stage
  stages:
    rlvr:        {recipe: tiny_grpo, overrides: [...]}
    teacher_add: {recipe: tiny_grpo, overrides: ["model.path=${stage:rlvr}", ...]}

`${stage:NAME}` is the final Hugging Face export of stage NAME (<dir>/NAME/final_hf): a
stage that names it depends on NAME, so the DAG comes from the checkpoint flow and no path
is typed twice. `after: [NAME]` adds an ordering edge that carries no checkpoint.

Command line (python -m hpc_rl.launch +pipeline=NAME ...): `pipeline.dir=DIR`,
`stages.NAME.KEY=VALUE` (one stage), anything else goes to every stage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

from hpc_rl.config.errors import ConfigError, Violation

STAGE_REF = re.compile(r"\$\{stage:([^}]*)\}")
STAGE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
STAGE_PREFIX = "stages."
DIR_KEY = "pipeline.dir"
SELECT_PREFIX = "+pipeline="


def pipelines_dir() -> Path:
    from hpc_rl.config.compose import recipes_dir

    return recipes_dir() / "pipeline"


def available() -> List[str]:
    return sorted(p.stem for p in pipelines_dir().glob("*.yaml"))


@dataclass
class Stage:
    name: str
    recipe: str
    overrides: List[str] = field(default_factory=list)
    after: List[str] = field(default_factory=list)  # ordering edges without a checkpoint

    def refs(self) -> List[str]:
        """Stages whose exports this stage reads, in order of first mention."""
        out: List[str] = []
        for o in self.overrides:
            for name in STAGE_REF.findall(o):
                if name not in out:
                    out.append(name)
        return out

    def deps(self) -> List[str]:
        return list(dict.fromkeys([*self.refs(), *self.after]))


@dataclass
class PipelineSpec:
    name: str
    dir: str
    stages: Dict[str, Stage]
    overrides: List[str] = field(default_factory=list)  # every stage
    notes: str = ""

    def order(self) -> List[str]:
        """Stages in dependency order (declaration order among equals); the DAG is checked first."""
        done: List[str] = []
        pending = list(self.stages)
        while pending:
            ready = [s for s in pending if all(d in done for d in self.stages[s].deps())]
            if not ready:  # check() reports the cycle; never loop here
                return done + pending
            done.append(ready[0])
            pending.remove(ready[0])
        return done

    def dependents(self, name: str) -> List[str]:
        """Every stage downstream of `name`, transitively."""
        out: List[str] = []
        frontier = [name]
        while frontier:
            cur = frontier.pop()
            for s in self.stages.values():
                if cur in s.deps() and s.name not in out:
                    out.append(s.name)
                    frontier.append(s.name)
        return [s for s in self.order() if s in out]

    def edges(self) -> List[Tuple[str, str]]:
        return [(d, s.name) for s in self.stages.values() for d in s.deps()]

    def check(self) -> List[Violation]:
        """The DAG's own problems: unknown stage references, cycles, bad names."""
        out: List[Violation] = []
        for s in self.stages.values():
            if not STAGE_NAME.match(s.name):
                out.append(Violation(f"stages.{s.name}", s.name, "a stage name must be a word (letters, digits, _)",
                                     "rename the stage in the pipeline file"))
            for d in s.deps():
                if d not in self.stages:
                    out.append(Violation(f"stages.{s.name}", f"${{stage:{d}}}" if d in s.refs() else d,
                                         "names no stage of this pipeline", f"use one of {sorted(self.stages)}"))
                elif d == s.name:
                    out.append(Violation(f"stages.{s.name}", d, "a stage cannot read its own output", "point it at an upstream stage"))
        order = self.order()
        stuck = [s for s in order if any(d in self.stages and order.index(d) > order.index(s) for d in self.stages[s].deps())]
        if stuck and not out:
            out.append(Violation("stages", stuck, "the stages depend on each other in a cycle", "remove one of the edges"))
        return out


def load_spec(name: str) -> PipelineSpec:
    path = pipelines_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError([Violation("pipeline", name, "no such pipeline", f"choose one of {available()}")])
    doc = yaml.safe_load(path.read_text()) or {}
    problems: List[Violation] = []
    stages: Dict[str, Stage] = {}
    for sname, body in (doc.get("stages") or {}).items():
        body = body or {}
        unknown = sorted(set(body) - {"recipe", "overrides", "after"})
        if unknown:
            problems.append(Violation(f"stages.{sname}", unknown, "unknown stage keys", "a stage has recipe, overrides and after"))
        if not body.get("recipe"):
            problems.append(Violation(f"stages.{sname}.recipe", None, "every stage needs a recipe", "set recipe: <one of recipes/recipe>"))
        stages[sname] = Stage(sname, str(body.get("recipe") or ""), [str(o) for o in body.get("overrides") or []],
                              [str(a) for a in body.get("after") or []])
    if not stages:
        problems.append(Violation("stages", None, f"{path} lists no stage", "add stages: {NAME: {recipe: ...}}"))
    if problems:
        raise ConfigError(problems)
    return PipelineSpec(name=str(doc.get("name") or name), dir=str(doc.get("dir") or f"runs/{name}"), stages=stages,
                        overrides=[str(o) for o in doc.get("overrides") or []], notes=str(doc.get("notes") or ""))


@dataclass
class CommandLine:
    """A pipeline command line split by where each override goes."""

    pipeline: Optional[str]
    dir: Optional[str]
    common: List[str]
    per_stage: Dict[str, List[str]]


def split_args(args: Sequence[str]) -> CommandLine:
    name = None
    pdir = None
    common: List[str] = []
    per_stage: Dict[str, List[str]] = {}
    for a in args:
        if a.startswith(SELECT_PREFIX) or a.startswith("pipeline="):
            name = a.split("=", 1)[1]
        elif a.startswith(DIR_KEY + "="):
            pdir = a.split("=", 1)[1]
        elif a.startswith(STAGE_PREFIX) and "." in a[len(STAGE_PREFIX):].split("=", 1)[0]:
            stage, rest = a[len(STAGE_PREFIX):].split(".", 1)
            per_stage.setdefault(stage, []).append(rest)
        else:
            common.append(a)
    return CommandLine(name, pdir, common, per_stage)

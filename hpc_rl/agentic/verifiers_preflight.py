"""The verifiers environment's preflight (issue 48): before a job is submitted
(launchers/runnable.py), the virtualenv's verifiers, in the jail the env rank's worker gets,
resolves, validates and loads the environment, builds its renderer with the policy's
tokenizer, starts each tool server of its first task and calls each tool once, then plays one
scripted episode through verifiers (verifiers_toolcheck.py). A broken environment is found in
seconds, before the allocation.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from hpc_rl.envs.jail import JailDir, unavailable

from .verifiers_bridge import (DIR_PREFIX, TOOLCHECK, episode_of, jailed, renderer_config, renderer_files, renderer_name,
                               venv_python)

PREFLIGHT = """
import json, sys
from verifiers.v1.utils.loaders import environment_class, load_environment, resolve_env_config
req = json.loads(sys.stdin.read())
cfg = resolve_env_config(req["env"])
env_cls = environment_class(cfg.taskset.id, cfg.id).__name__
env = load_environment(cfg)
tasks = list(env.taskset)
tools = [type(s).__name__ for s in env.taskset.toolsets(env.taskset.config)]
if tasks:
    tools += [type(s).__name__ for s in type(tasks[0]).toolsets(tasks[0].config)]
problem = None
try:
    from renderers import create_renderer
    from renderers.base import RENDERER_REGISTRY
    from renderers.parsers import TOOL_PARSERS
    from transformers import AutoTokenizer
    from verifiers.v1 import TrainClientConfig
    rc = TrainClientConfig(renderer=req["renderer"]).renderer
    renderer = create_renderer(AutoTokenizer.from_pretrained(req["tokenizer"]), rc)
    if tools and not getattr(renderer, "supports_tools", True):
        problem = (type(renderer).__name__ + " reads no tool calls, and this taskset's tasks have tools ("
                   + ", ".join(tools) + ")")
except Exception as exc:
    problem = type(exc).__name__ + ": " + str(exc)[:400]
sys.path.insert(0, req["here"])
from verifiers_toolcheck import check, scripted_episode
tool_problems = check(env)
if not tool_problems and not problem and req["tokenizer"]:
    tool_problems = scripted_episode(env, req["renderer"], req["tokenizer"])
names = sorted(RENDERER_REGISTRY) if "RENDERER_REGISTRY" in dir() else []
parsers = sorted(TOOL_PARSERS) if "TOOL_PARSERS" in dir() else []
print(json.dumps({"env": env_cls, "tasks": len(tasks), "tools": tools, "renderer_problem": problem,
                  "tool_problems": tool_problems,
                  "renderers": names, "tool_parsers": parsers}))
"""


def preflight(v, tokenizer: str = "", tool_parser: str = "pythonic") -> list:
    """Before a launch (launchers/runnable.py): the virtualenv's verifiers resolves, validates
    and loads the environment (the taskset importable, its args, the harness id, the runtime
    type), and builds the renderer (env.agentic.verifiers.renderer, or its default from
    `tool_parser`) with the policy's `tokenizer`: a taskset with tools needs one that reads
    tool calls; each tool server of the first task started and each tool called once
    (verifiers_toolcheck.py). `v`: env.agentic.verifiers. Returns (key, value, why, fix) for
    each problem."""
    python = venv_python(v.python)
    if not python.exists():
        return []  # config/validate_agentic.py names the missing virtualenv
    if unavailable():
        return [("env.agentic.environment", "verifiers", unavailable(), "install bubblewrap on the env nodes")]
    env = episode_of(v).env_config()
    name = renderer_name(v.renderer, tool_parser)
    req = {"env": env, "renderer": renderer_config(name), "tokenizer": tokenizer, "here": str(TOOLCHECK.parent)}
    home = JailDir(DIR_PREFIX)  # in the jail the worker runs in: what resolves there, resolves for the worker
    read_only = ([tokenizer] if tokenizer and Path(tokenizer).exists() else []) + renderer_files(req["renderer"])
    try:
        proc = subprocess.run(jailed(python, ["-c", PREFLIGHT], home.path, read_only), input=json.dumps(req),
                              capture_output=True, text=True, timeout=300,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except (OSError, subprocess.TimeoutExpired) as exc:
        proc = subprocess.CompletedProcess([], 1, "", f"{type(exc).__name__}: {exc}")
    finally:
        home.close()
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
        last = " | ".join(lines[-3:]) or f"rc {proc.returncode}"
        return [("env.agentic.verifiers", env, f"verifiers could not load this environment: {last[:600]}",
                 "fix env.agentic.verifiers.taskset / taskset_args / harness / runtime, or install the taskset's "
                 f"package into {python.parent.parent} ({python.parent}/pip install -e DIR)")]
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return [("env.agentic.verifiers", env, f"the preflight printed no answer: {proc.stdout[-300:]!r}",
                 "run the taskset in the virtualenv by hand to see why")]
    found = [tool_problem(v.taskset, p, python.parent.parent) for p in out.get("tool_problems") or ()]
    if out.get("renderer_problem"):
        key = "env.agentic.verifiers.renderer" if v.renderer else "env.agentic.tool_parser"
        value = v.renderer if v.renderer else tool_parser
        return [(key, value, f"verifiers' renderer {name or 'auto'!r} for {tokenizer}: {out['renderer_problem']}",
                 "set env.agentic.verifiers.renderer to the policy's format: `pythonic` ([f(a=\"1\")] calls), "
                 f"`default:<tool parser>` ({', '.join(out.get('tool_parsers') or [])}), one of verifiers' renderers "
                 f"({', '.join(out.get('renderers') or [])}), or `custom:<module.Class or file.py:Class>`")]
    return found


SCRIPTED = "scripted episode"  # verifiers_toolcheck.scripted_episode's problems (that module is the venv's)


def tool_problem(taskset: str, p: dict, venv: Path) -> tuple:
    """A problem of the tool check or the scripted episode as (key, value, why, fix)."""
    if p["server"] == SCRIPTED:
        return ("env.agentic.verifiers.taskset", taskset, f"one scripted episode of its first task failed: {p['why']}",
                "the preflight played it through verifiers (harness, renderer, tool servers, rubric) with a policy "
                "that calls the first tool once and answers '1' (agentic/verifiers_toolcheck.py): fix what failed in "
                f"the taskset's package and reinstall it into {venv}, or set env.agentic.verifiers.renderer")
    where = f"tool server {p['server']}" + (f", tool {p['tool']!r}" if p.get("tool") else "")
    return ("env.agentic.verifiers.taskset", taskset, f"{where}: {p['why']}",
            "fix that tool server in the taskset's package (the preflight started it as verifiers does and called "
            f"each tool once with sample arguments, agentic/verifiers_toolcheck.py), then reinstall it into {venv}")

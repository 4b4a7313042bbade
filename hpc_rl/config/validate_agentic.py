"""Validation of multi-turn episodes (`env.agentic`), beside validate.py."""

from __future__ import annotations

from typing import List

from .errors import Violation, check_positive
from .schema import RunConfig


def check_verifiers(out: List[Violation], cfg: RunConfig) -> None:
    """env.agentic.verifiers: set only for a verifiers environment, and then complete."""
    from hpc_rl.agentic.verifiers_bridge import venv_python

    a, v = cfg.env.agentic, cfg.env.agentic.verifiers
    if a.environment != "verifiers":
        if v.taskset is not None or v.taskset_args:
            out.append(Violation("env.agentic.verifiers.taskset", v.taskset, "is read only by a verifiers environment",
                                 "set env.agentic.environment=verifiers, or leave env.agentic.verifiers unset"))
        if v.renderer is not None:
            out.append(Violation("env.agentic.verifiers.renderer", v.renderer, "is read only by a verifiers environment",
                                 "set env.agentic.environment=verifiers, or leave env.agentic.verifiers.renderer unset"))
        return
    if v.renderer is not None and (not v.renderer.strip() or v.renderer in ("default:", "custom:")):
        out.append(Violation("env.agentic.verifiers.renderer", v.renderer, "names no renderer",
                             "set a renderer of verifiers' renderers package (e.g. qwen3), `pythonic`, "
                             "`default:<tool parser>` (e.g. default:qwen3) or `custom:<module.Class>`; or leave it unset "
                             "(from env.agentic.tool_parser)"))
    if not v.taskset:
        out.append(Violation("env.agentic.verifiers.taskset", v.taskset, "a verifiers environment needs its taskset id",
                             "set env.agentic.verifiers.taskset (e.g. tiny-arith), a package of the verifiers virtualenv"))
    if not venv_python(v.python).exists():
        out.append(Violation("env.agentic.verifiers.python", v.python, f"{venv_python(v.python)} does not exist",
                             "run `make verifiers-env` (verifiers 0.4.0 in .venv-verifiers), or point it at a "
                             "virtualenv's python that has verifiers==0.4.0 and the taskset installed"))


def check_gym(out: List[Violation], cfg: RunConfig) -> None:
    """env.agentic.gym: set only for a NeMo Gym environment, and then complete."""
    from pathlib import Path

    from hpc_rl.agentic.gym_servers import REPO, interpreter

    a, g = cfg.env.agentic, cfg.env.agentic.gym
    if a.environment != "gym":
        if g.resources_server is not None or g.dataset is not None:
            out.append(Violation("env.agentic.gym.resources_server", g.resources_server,
                                 "is read only by a NeMo Gym environment",
                                 "set env.agentic.environment=gym, or leave env.agentic.gym unset"))
        return
    if not g.resources_server:
        out.append(Violation("env.agentic.gym.resources_server", g.resources_server,
                             "a NeMo Gym environment needs its resources server's name",
                             "set env.agentic.gym.resources_server (e.g. tiny_arith with search_dirs [environments/gym])"))
    if not g.dataset:
        out.append(Violation("env.agentic.gym.dataset", g.dataset, "a NeMo Gym environment needs the rows it plays",
                             "set env.agentic.gym.dataset to a Gym dataset JSONL"))
    elif not (Path(g.dataset) if Path(g.dataset).is_absolute() else REPO / g.dataset).exists():
        out.append(Violation("env.agentic.gym.dataset", g.dataset, "does not exist",
                             "set env.agentic.gym.dataset to a Gym dataset JSONL (relative to the repository, or absolute)"))
    if not Path(interpreter(g.python)[0]).exists():
        out.append(Violation("env.agentic.gym.python", g.python, f"{interpreter(g.python)[0]} does not exist",
                             "point env.agentic.gym.python at a Python >= 3.13.14 with nemo-gym 0.7.0 installed (on a "
                             "cluster: the environment nodes' container image; on a test machine, `make gym-python` "
                             "builds .gym-python)"))


def check_sandbox(out: List[Violation], cfg: RunConfig) -> None:
    """env.agentic.sandbox: set only for the python_tool environment, and then runnable."""
    import dataclasses
    import shutil

    from .schema_agentic import SandboxConfig

    a, s = cfg.env.agentic, cfg.env.agentic.sandbox
    if a.environment != "python_tool":
        for f in dataclasses.fields(SandboxConfig):
            if getattr(s, f.name) != f.default:
                out.append(Violation(f"env.agentic.sandbox.{f.name}", getattr(s, f.name),
                                     "is read only by the python_tool environment",
                                     "set env.agentic.environment=python_tool, or leave env.agentic.sandbox unset"))
        return
    if s.kind != "bwrap":
        found = shutil.which(s.kind)
        where = f"{s.kind} is at {found}" if found else f"there is no {s.kind} on this host's PATH"
        # the command line is rendered (envs/container_sandbox.py, docs/agentic.md), never run
        out.append(Violation("env.agentic.sandbox.kind", s.kind,
                             f"this version renders the {s.kind} sandbox's command line but does not run it ({where}; "
                             f"a CPU cluster such as this one has no container runtime for it)",
                             "set env.agentic.sandbox.kind=bwrap (bubblewrap 0.8+ on the env nodes)"))
    for key in ("cpu_s", "memory_mb", "output_bytes"):
        check_positive(out, f"env.agentic.sandbox.{key}", getattr(s, key))
    if not s.wall_s > 0:
        out.append(Violation("env.agentic.sandbox.wall_s", s.wall_s, "must be positive", "set env.agentic.sandbox.wall_s > 0"))
    elif s.wall_s > a.turn_timeout_s:
        out.append(Violation("env.agentic.sandbox.wall_s", s.wall_s,
                             f"exceeds env.agentic.turn_timeout_s={a.turn_timeout_s}: a slow tool would end the episode "
                             "(env_timeout) before the policy reads its timeout",
                             "set env.agentic.sandbox.wall_s <= env.agentic.turn_timeout_s"))
    if s.scoring_buffer_s < 0:
        out.append(Violation("env.agentic.sandbox.scoring_buffer_s", s.scoring_buffer_s, "must be >= 0",
                             "set env.agentic.sandbox.scoring_buffer_s >= 0 (seconds a tool may outlive its episode's deadline)"))


def check_agentic(out: List[Violation], cfg: RunConfig) -> None:
    a = cfg.env.agentic
    check_verifiers(out, cfg)
    check_gym(out, cfg)
    check_sandbox(out, cfg)
    if a.environment is None:
        return
    from hpc_rl.agentic.environments import environment_factory, known_environments

    try:
        environment_factory(a.environment)
    except KeyError as exc:
        out.append(Violation("env.agentic.environment", a.environment, str(exc.args[0]),
                             f"set env.agentic.environment to one of {known_environments()}, a 'package.module:factory' "
                             "importable here and on the env ranks, or null for single-turn verifiers"))
    for key in ("max_turns", "max_tokens", "turn_timeout_s", "episode_timeout_s", "max_inflight_episodes"):
        check_positive(out, f"env.agentic.{key}", getattr(a, key))
    if not 0.0 <= a.max_error_share <= 1.0:
        out.append(Violation("env.agentic.max_error_share", a.max_error_share,
                             "is a share of a step's episodes, between 0 and 1",
                             "set env.agentic.max_error_share in [0, 1] (0: any failed episode ends the run; 1: never)"))
    if cfg.env.nodes < 1:
        # the env ranks run the episodes: without them nobody would talk to the endpoint
        out.append(Violation("env.nodes", cfg.env.nodes, "env.agentic.environment needs env ranks to run the episodes",
                             "set env.nodes >= 1"))
    max_len = cfg.generator.max_model_len or cfg.trainer.max_seq_len
    if a.max_tokens > max_len:
        out.append(Violation("env.agentic.max_tokens", a.max_tokens,
                             f"a trajectory (its first prompt included) must fit the model length {max_len}",
                             f"set env.agentic.max_tokens <= {max_len} (or raise generator.max_model_len and trainer.max_seq_len)"))
    if a.turn_timeout_s > a.episode_timeout_s:
        out.append(Violation("env.agentic.turn_timeout_s", a.turn_timeout_s,
                             f"exceeds env.agentic.episode_timeout_s={a.episode_timeout_s}: the episode's deadline would cut every slow turn first",
                             "set env.agentic.turn_timeout_s <= env.agentic.episode_timeout_s"))
    if a.max_inflight_episodes > cfg.generator.max_num_seqs:
        # more episodes than the engine runs at once would queue inside vLLM, each holding a connection
        out.append(Violation("env.agentic.max_inflight_episodes", a.max_inflight_episodes,
                             f"exceeds generator.max_num_seqs={cfg.generator.max_num_seqs}, the sequences one engine runs at once",
                             f"set env.agentic.max_inflight_episodes <= {cfg.generator.max_num_seqs} or raise generator.max_num_seqs"))
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:  # a launching host without vLLM: the generator checks it when its engine starts
        return
    known = ToolParserManager.list_registered() if hasattr(ToolParserManager, "list_registered") else list(
        getattr(ToolParserManager, "tool_parsers", {}))
    if known and a.tool_parser not in known:
        out.append(Violation("env.agentic.tool_parser", a.tool_parser, "is not one of vLLM's tool parsers",
                             f"set env.agentic.tool_parser to one of {sorted(known)[:12]}... (pythonic needs no special tokens)"))

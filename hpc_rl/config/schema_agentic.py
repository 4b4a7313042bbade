"""The schema of multi-turn, tool-using episodes (`env.agentic`), beside schema.py.

Its comments document the keys like schema.py's do (hpc_rl/config/reference.py reads both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Literal, Optional

from .trace import Traced


@dataclass
class VerifiersConfig(Traced):
    """A verifiers (0.4.0, prime-rl's library) environment run unchanged
    (hpc_rl/agentic/verifiers_bridge.py), used when env.agentic.environment is `verifiers`.
    verifiers runs in its own virtualenv (`make verifiers-env`); its model calls reach the
    generator's token route through a loopback proxy on the env rank."""

    # The verifiers taskset id: a package installed in that virtualenv (tiny-arith: the repo's
    # environments/tiny_arith). Required with env.agentic.environment=verifiers.
    taskset: Optional[str] = None
    # The taskset's config fields, as text (verifiers' own config checks and converts them),
    # e.g. {num_tasks: "512", operation: plus}.
    taskset_args: Dict[str, str] = field(default_factory=dict)
    harness: str = "null"  # verifiers' agent harness id (null: its plain chat loop, tools through MCP)
    runtime: str = "subprocess"  # verifiers' runtime type for the harness's program (subprocess: on the env node)
    # The virtualenv's python (relative to the repository, or absolute): made by `make verifiers-env`.
    python: str = ".venv-verifiers/bin/python"
    # How verifiers renders prompts and reads tool calls (its `renderers` package): a renderer
    # name of that package (e.g. qwen3, llama-3, nemotron-3, default: the chat template without
    # tools), `default:<tool parser>` (the chat template with one of its tool parsers, e.g.
    # default:qwen3 for <tool_call>{json}</tool_call>), `pythonic` (hpc_rl's renderer for
    # pythonic calls `[f(a="1")]`, agentic/verifiers_renderer.py) or `custom:<module.Class or
    # file.py:Class>`. None: from env.agentic.tool_parser (pythonic -> pythonic, hermes ->
    # default:qwen3), else verifiers' own choice by model name. Checked before submission
    # against the virtualenv's renderers and the policy's tokenizer.
    renderer: Optional[str] = None


@dataclass
class GymConfig(Traced):
    """A NeMo Gym (nemo-gym 0.7.0) environment run unchanged (hpc_rl/agentic/gym_bridge.py),
    used when env.agentic.environment is `gym`. Each env rank starts the environment's Gym
    servers under Gym's own interpreter and plays each episode as one call to Gym's agent;
    Gym's model calls reach the generator through a loopback proxy on the env rank."""

    # The Gym resources server's name: a Gym built-in (e.g. mcqa) or one under search_dirs
    # (tiny_arith: the repo's environments/gym). Required with env.agentic.environment=gym.
    resources_server: Optional[str] = None
    # The JSONL of Gym rows (responses_create_params plus the verifier's fields) the episodes
    # play, relative to the repository or absolute; each prompt record picks one by its id.
    dataset: Optional[str] = None
    # The agent server (Gym's process name, e.g. tiny_arith_simple_agent) each episode calls;
    # None: the environment's only agent.
    agent: Optional[str] = None
    # Gym's interpreter, a command (relative to the repository, or absolute) whose Python has
    # nemo-gym: tests/gym_python.sh makes .gym-python/bin/gym-python.
    python: str = ".gym-python/bin/gym-python"
    # Directories Gym searches for servers besides its own (`gym env start --search-dir`),
    # relative to the repository or absolute.
    search_dirs: List[str] = field(default_factory=list)
    # Extra `gym env start` overrides (Hydra syntax, e.g. "+policy_model.responses_api_models.vllm_model.uses_reasoning_parser=false").
    args: List[str] = field(default_factory=list)
    # Gym's servers (and the Ray cluster Gym starts) in a network namespace of their own
    # (bubblewrap --unshare-net), reached only through unix sockets in a 0700 directory: no
    # port of theirs is reachable from the node. false: they listen on 127.0.0.1 without a key.
    private_network: bool = True


@dataclass
class SandboxConfig(Traced):
    """The sandbox the python_tool environment runs each tool call in (hpc_rl/envs/sandbox.py:
    bubblewrap, no network, read-only root, a private /tmp), used when
    env.agentic.environment is `python_tool`. Each call is a fresh sandbox; the limits are
    per call."""

    # bwrap: bubblewrap 0.8+ on the env nodes. apptainer / enroot: their command lines are
    # rendered (docs/agentic.md) but this version does not run them: refused at validation.
    kind: Literal["bwrap", "apptainer", "enroot"] = "bwrap"
    wall_s: float = 10.0  # one call's wall time; past it the sandbox is killed and the policy reads a timeout
    cpu_s: int = 10  # one call's CPU seconds (RLIMIT_CPU: SIGXCPU)
    memory_mb: int = 1024  # one call's address space in MiB (RLIMIT_AS: an allocation past it fails)
    output_bytes: int = 4096  # what the policy reads of each of stdout and stderr; the rest is dropped
    # A tool call's hard lifetime is its episode's deadline (env.agentic.episode_timeout_s from
    # the episode's start) plus this buffer, whatever wall_s says; a collection round ends
    # when every sandbox it started has.
    scoring_buffer_s: float = 5.0


@dataclass
class AgenticConfig(Traced):
    """Multi-turn episodes (hpc_rl/agentic/): the env ranks talk to the policy over many turns
    through their generator's endpoint (hpc_rl/serving/) and call tools; each episode
    becomes a token-exact trajectory in which only the policy's tokens are trained on."""

    # A registered environment (hpc_rl/agentic/environments.py: calculator, python_tool: the
    # calculator's task with a sandboxed Python tool, configured by env.agentic.sandbox;
    # single_turn, verifiers:
    # a verifiers environment, configured by env.agentic.verifiers; gym: a NeMo Gym
    # environment, configured by env.agentic.gym) or a
    # 'package.module:factory' the env ranks import. None: single-turn verifiers score one
    # answer per prompt (no endpoint is started).
    environment: Optional[str] = None
    max_turns: int = 4  # the policy's turns per episode; an episode still going after them is truncated
    # Tokens per trajectory, the first prompt included (the context the policy must hold); a
    # turn samples at most what is left, and at most generator.sampling.max_tokens.
    max_tokens: int = 128
    turn_timeout_s: float = 120.0  # one policy turn (a request to the endpoint); past it the episode is truncated
    episode_timeout_s: float = 600.0  # one whole episode, tools included; past it the episode is truncated
    truncated_reward: float = 0.0  # the reward of a truncated episode (it keeps its tokens and is trained on)
    # The share (0..1) of a training step's episodes that may fail (raise, or hang past
    # episode_timeout_s, or an environment call past turn_timeout_s; each scores 0 or
    # truncated_reward and is counted by kind) before the run ends naming the environment,
    # instead of training that step. 1.0: never end the run for failed episodes.
    max_error_share: float = 0.25
    # Episodes one env rank runs at once per generator (engine) it serves: each engine is
    # served by one env rank, so this is also the engine's limit; an env rank serving k
    # engines runs up to k times as many. Also the size of the HTTP connection pool to
    # each endpoint, never a library default.
    max_inflight_episodes: int = 64
    # vLLM's tool parser (its ToolParserManager name) for the endpoint's chat route and the
    # episodes' tool calls: `pythonic` needs no special tokens (the tiny models' format).
    tool_parser: str = "pythonic"
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)  # with environment=verifiers
    gym: GymConfig = field(default_factory=GymConfig)  # with environment=gym
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # with environment=python_tool

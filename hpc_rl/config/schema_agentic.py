"""The schema of multi-turn, tool-using episodes (`env.agentic`), beside schema.py.

Its comments document the keys like schema.py's do (hpc_rl/config/reference.py reads both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

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


@dataclass
class AgenticConfig(Traced):
    """Multi-turn episodes (hpc_rl/agentic/): the env ranks talk to the policy over many turns
    through their generator's endpoint (hpc_rl/serving/) and call tools; each episode
    becomes a token-exact trajectory in which only the policy's tokens are trained on."""

    # A registered environment (hpc_rl/agentic/contract.py: calculator, single_turn, verifiers:
    # a verifiers environment, configured by env.agentic.verifiers) or a
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

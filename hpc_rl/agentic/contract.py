"""The environment contract: what an agentic environment implements, and the limits it runs
under. docs/agentic.md explains it for a newcomer.

An environment is an `Episode`: `await episode.run(task, chat) -> EpisodeResult`. `chat` is
given by the framework (chat.py): `await chat(messages, tools=None)` returns the policy's
next assistant message (OpenAI shape, tool calls parsed) and records every token on the way,
so the episode never handles token ids and cannot get them wrong.

Most environments are easier to write step-wise (`reset`/`step`, as in gym); `StepwiseEpisode`
turns such a class into an Episode. Today's single-turn verifiers (envs/registry.py) are
one-turn episodes through `SingleTurnEpisode`. Environments are registered by the name a
config gives (`env.agentic.environment`).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, List, Optional, Protocol, Tuple

from hpc_rl.envs.reward_check import checked_reward

# async policy(prompt_ids, max_tokens) -> (ids, logprobs, version_first, version_last,
# finish_reason[, per-token versions]): the generator's token route (serving client) in a
# run, a local engine or model in tests (local.py).
Policy = Callable[[List[int], int], Awaitable[tuple]]


@dataclass
class EpisodeResult:
    reward: float
    correct: Optional[bool] = None
    truncated: bool = False  # cut short by a limit (turns, tokens, a timeout): scored by Limits.truncated_reward
    info: dict = field(default_factory=dict)


class Chat(Protocol):
    async def __call__(self, messages: List[dict], tools: Optional[list] = None) -> dict: ...


class Episode(Protocol):
    async def run(self, task: dict, chat: Chat) -> EpisodeResult: ...


class Truncated(Exception):
    """Raised by the chat when a limit ends the episode; the runner scores it
    `Limits.truncated_reward`. An episode need not catch it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    max_turns: int = 8  # policy calls per episode
    # tokens of the whole trajectory, first prompt included: the context the policy must hold
    max_tokens: int = 256
    max_tokens_per_turn: Optional[int] = None  # a single call's cap (None: what is left of max_tokens)
    turn_timeout_s: Optional[float] = 60.0  # one policy call, or one environment step
    episode_timeout_s: Optional[float] = 600.0  # the whole episode (asyncio.wait_for)
    truncated_reward: float = 0.0  # the reward of a truncated episode

    def __post_init__(self):
        if self.max_turns < 1 or self.max_tokens < 1:
            raise ValueError(f"max_turns and max_tokens must be >= 1, got {self.max_turns}, {self.max_tokens}")
        # every truncated episode is scored this: it must pass the check every reward passes
        checked_reward(self.truncated_reward, "env.agentic.truncated_reward")


def _in_daemon_thread(fn: Callable, *args) -> "asyncio.Future":
    """`fn(*args)` in a daemon thread of its own, as a future of this loop. Not the loop's
    default executor: a hung call in it would hold up asyncio.run's exit (it joins that
    executor's threads) and the interpreter's; a daemon thread is left behind instead."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def deliver(ok: bool, value) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def target() -> None:
        try:
            out = (True, fn(*args))
        except BaseException as exc:  # handed to the awaiting episode
            out = (False, exc)
        try:
            loop.call_soon_threadsafe(deliver, *out)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=target, daemon=True, name="hpc_rl-env-step").start()
    return fut


async def call_env(fn: Callable, *args, timeout_s: Optional[float] = None) -> Any:
    """Call an environment method, async or not, bounded by `timeout_s`. A plain function
    runs in a thread: a slow one (a sandbox, a judge) must not stall the other episodes on
    the event loop; a hung one times out here (its thread is left to finish on its own)."""
    if inspect.iscoroutinefunction(fn):
        coro = fn(*args)
    else:
        coro = _in_daemon_thread(fn, *args)
    try:
        out = await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError:
        raise Truncated("env_timeout") from None
    return await out if inspect.isawaitable(out) else out


class StepwiseEnv(Protocol):
    """gym-style: `reset(task) -> first messages`; `step(assistant message) -> (new messages,
    done, reward, correct)`. Either may be async. `tools` (optional attribute): the OpenAI
    tool specs offered to the policy."""

    def reset(self, task: dict) -> List[dict]: ...

    def step(self, message: dict) -> Tuple[List[dict], bool, float, Optional[bool]]: ...


class StepwiseEpisode:
    """A step-wise environment as an Episode: one fresh env (from `make_env`) per episode."""

    def __init__(self, make_env: Callable[[], StepwiseEnv], turn_timeout_s: Optional[float] = None):
        self.make_env = make_env
        self.turn_timeout_s = turn_timeout_s  # the runner sets it from Limits

    async def run(self, task: dict, chat: Chat) -> EpisodeResult:
        env = self.make_env()
        timeout = getattr(chat, "turn_timeout_s", None) or self.turn_timeout_s
        messages = list(await call_env(env.reset, task, timeout_s=timeout))
        tools = getattr(env, "tools", None)
        while True:
            msg = await chat(messages, tools=tools)
            messages.append(msg)
            new, done, reward, correct = await call_env(env.step, msg, timeout_s=timeout)
            if done:  # a reward that is not a finite number is this episode's error, by kind
                return EpisodeResult(checked_reward(reward, f"{type(env).__name__}.step"), correct)
            messages.extend(new)


class SingleTurnEpisode:
    """Today's single-turn tasks as one-turn episodes: the task's prompt as the user message,
    the answer scored by the task's verifier (envs/registry.py)."""

    async def run(self, task: dict, chat: Chat) -> EpisodeResult:
        from hpc_rl.envs.registry import score

        msg = await chat([{"role": "user", "content": task["prompt"]}])
        r = score(task["task"], msg["content"], task["answer"])
        if r.error is not None:  # the verifier raised or returned a bad reward: counted by its kind
            raise ScoringFailed(r.error, r.reason or "")
        return EpisodeResult(r.reward, r.correct, info={"extracted": r.extracted})


class ScoringFailed(RuntimeError):
    """A verifier's failure (registry.score caught it) raised as the episode's error, counted
    under the original kind (`error_kind`, which faults.error_kind reads)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.error_kind = kind


def stable_index(task: dict, n: int) -> int:
    """Which of an adapted library's `n` tasks an item plays: a stable function of the item's
    id (its prompt without one), so a GRPO group (one id) plays one task and a resumed step
    plays the same ones."""
    key = str(task.get("id") if task.get("id") is not None else task.get("prompt"))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % n

"""Run episodes concurrently and turn them into trajectories (SampleRows with a loss mask).

Concurrency is one asyncio.Semaphore(max_inflight) and nothing else: no actor pool, no
connection pool between the episodes and the policy's default limits (the anchors' users
found Ray's default actor concurrency and aiohttp's 100-connection default capping rollouts
silently). The peak reached is reported, so a cap that bites shows up as a number.

An episode that raises, or returns a reward that is not a finite number within bounds
(envs/reward_check.py: NonNumericReward, NonFiniteReward, RewardOutOfBounds), is scored 0 and
counted (`errors`, `errors_by_kind`), never a crash of the batch nor a NaN for the trainer;
one that hits a limit is marked truncated and scored `Limits.truncated_reward`, a timeout
among them counted by kind (`timeouts_by_kind`; faults.py says which are failures).

Backpressure, measured: the most episodes in flight at once (`max_inflight`, against the
limit), how many waited for a slot (`max_queue_depth`) and how long (`queue_wait_s`), and the
environment's time after each policy turn (`tool_latency_s`: its tool calls and step, up to
the next policy request or the episode's end).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from hpc_rl.engines.rows import SampleRow
from hpc_rl.envs.reward_check import checked_reward

from .chat import RecordingChat
from .contract import Episode, EpisodeResult, Limits, Policy, Truncated
from .faults import FAILED_BY, TIMEOUT_KINDS, error_kind, traceback_line
from .figures import latency_figures
from .history import changed_policy_tokens


async def run_episode(task: dict, episode: Episode, policy: Policy, tokenizer, limits: Limits = Limits(),
                      tool_parser: str = "pythonic", template_kwargs: Optional[dict] = None
                      ) -> Tuple[List[SampleRow], EpisodeResult]:
    """One episode: (its rows, possibly empty when no policy token was generated, its result).
    result.info holds turns, siblings, tool_parse_errors, tool_calls (parsed from the policy's
    turns, or as the environment reports them), tool_errors, changed_policy_tokens,
    tool_latency_s (the environment's seconds after each policy turn), and `truncated_by`
    or `error` (with `error_kind` and `error_line`, its traceback's last line) when it applies."""
    chat = RecordingChat(policy, tokenizer, limits, tool_parser, template_kwargs)
    try:
        result = checked_result(await asyncio.wait_for(episode.run(task, chat), limits.episode_timeout_s),
                                f"{type(episode).__name__}.run")
        if chat.hit_token_cap and not result.truncated:
            # the policy was still writing when the trajectory's token budget ran out: what
            # the environment made of the cut text is not the episode's real outcome
            result = EpisodeResult(limits.truncated_reward, False, True, dict(result.info, truncated_by="max_tokens"))
    except Truncated as t:
        result = EpisodeResult(limits.truncated_reward, False, True, {"truncated_by": t.reason})
    except asyncio.TimeoutError:
        result = EpisodeResult(limits.truncated_reward, False, True, {"truncated_by": "episode_timeout"})
    except Exception as exc:  # the environment's bug or a failed policy call: this episode only
        result = EpisodeResult(0.0, False, False, {"error": f"{type(exc).__name__}: {exc}", "error_kind": error_kind(exc),
                                                   "error_line": traceback_line(exc)})
    rows = chat.history.rows(truncated=result.truncated)
    # an adapted library parses and runs its own tool calls and reports them (info tool_calls, tool_errors)
    result.info.setdefault("tool_calls", chat.tool_calls)
    result.info.setdefault("tool_errors", 0)
    result.info.update(turns=chat.turns, siblings=chat.history.siblings, tool_parse_errors=chat.tool_parse_errors,
                       changed_policy_tokens=changed_policy_tokens(rows, chat.history.row_turns()),
                       tool_latency_s=chat.env_seconds(time.perf_counter()))
    return rows, result


def checked_result(result: EpisodeResult, source: str = "the environment") -> EpisodeResult:
    """What an episode returned, as the trainer may take it: a reward reward_check accepts (a
    finite number within bounds; else NonNumericReward / NonFiniteReward / RewardOutOfBounds,
    raised here so the episode is an error counted by kind, scored 0), `correct` a bool or
    None, `info` a dict. Anything else (not an EpisodeResult, an info of another type) raises
    too: an environment's bug is its episode's error, never the env rank's crash."""
    if not isinstance(result.info, dict):
        raise TypeError(f"the episode's result info is {type(result.info).__name__}, not a dict")
    correct = None if result.correct is None else bool(result.correct)
    return EpisodeResult(checked_reward(result.reward, source), correct,
                         bool(result.truncated), dict(result.info))


@dataclass
class EpisodeBatch:
    """What `run_episodes` returns: per task (rows, result), in the tasks' order, and counts."""

    episodes: List[Tuple[List[SampleRow], EpisodeResult]] = field(default_factory=list)
    max_inflight: int = 0  # the most episodes that ran at once
    inflight_limit: int = 0  # the limit they ran under
    max_queue_depth: int = 0  # the most episodes waiting for a slot at once
    queue_wait_s: float = 0.0  # their seconds waiting for a slot, summed
    seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.episodes)

    def __iter__(self):
        return iter(self.episodes)

    def __getitem__(self, i):
        return self.episodes[i]

    def metrics(self) -> dict:
        results = [r for _, r in self.episodes]
        rows = [row for rs, _ in self.episodes for row in rs]
        policy = sum(sum(r.loss_mask) if r.loss_mask is not None else len(r.response_ids) for r in rows)
        n = max(1, len(results))
        return {
            "episodes": len(results),
            "errors": sum("error" in r.info for r in results),
            "truncated": sum(r.truncated for r in results),
            "siblings": sum(r.info.get("siblings", 0) for r in results),
            "turns": sum(r.info.get("turns", 0) for r in results),
            "tool_parse_errors": sum(r.info.get("tool_parse_errors", 0) for r in results),
            "tool_calls": sum(r.info.get("tool_calls", 0) for r in results),
            "tool_errors": sum(r.info.get("tool_errors", 0) for r in results),
            "changed_policy_tokens": sum(r.info.get("changed_policy_tokens", 0) for r in results),
            "policy_tokens": policy,
            "env_tokens": sum(len(r.response_ids) for r in rows) - policy,
            "mean_reward": sum(r.reward for r in results) / n,
            "accuracy": sum(bool(r.correct) for r in results) / n,
            "max_inflight": self.max_inflight,
            "inflight_limit": self.inflight_limit,
            "max_queue_depth": self.max_queue_depth,
            "queue_wait_s_mean": self.queue_wait_s / n,
            "seconds": self.seconds,
            **fault_counts(results),
            **latency_figures(self.tool_latencies()),
        }

    def tool_latencies(self) -> List[float]:
        return [s for _, r in self.episodes for s in r.info.get("tool_latency_s", ())]

    def error_lines(self) -> Dict[str, str]:
        """kind -> the traceback line of its first episode, in task order."""
        out: Dict[str, str] = {}
        for _, r in self.episodes:
            if "error_kind" in r.info:
                out.setdefault(r.info["error_kind"], r.info.get("error_line", r.info["error"]))
        return out


def fault_counts(results: Sequence[EpisodeResult]) -> dict:
    """errors (by kind), timeouts (by kind) and failed episodes (faults.py) of some results."""
    by_kind: Dict[str, int] = {}
    for r in results:
        if "error_kind" in r.info:
            by_kind[r.info["error_kind"]] = by_kind.get(r.info["error_kind"], 0) + 1
    timeouts = {k: sum(r.info.get("truncated_by") == k for r in results) for k in TIMEOUT_KINDS}
    return {"errors_by_kind": by_kind, "timeouts": sum(timeouts.values()), "timeouts_by_kind": timeouts,
            "failed": sum("error" in r.info for r in results) + sum(timeouts[k] for k in FAILED_BY)}


class InflightGauge:
    """Episodes in flight across several `run_episodes` calls of one event loop (an env
    rank serving several engines): the current count and its peak."""

    def __init__(self):
        self.now = self.peak = 0

    def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self.now -= 1


async def run_episodes(tasks: Sequence[dict], env: Episode, policy: Union[Policy, Sequence[Policy]], limits: Limits,
                       tokenizer, max_inflight: int, tool_parser: str = "pythonic",
                       template_kwargs: Optional[dict] = None, gauge: Optional[InflightGauge] = None) -> EpisodeBatch:
    """Every task's episode, at most `max_inflight` at once. `policy`: one for all, or one
    per task (a run's: each request seeded by its item and turn). `gauge`: also counts
    them there (shared by the calls of one env rank)."""
    if max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
    sem = asyncio.Semaphore(max_inflight)
    batch = EpisodeBatch(inflight_limit=max_inflight)
    running = waiting = 0

    policies = [policy] * len(tasks) if callable(policy) else list(policy)
    if len(policies) != len(tasks):
        raise ValueError(f"{len(policies)} policies for {len(tasks)} tasks")

    async def one(task: dict, pol: Policy):
        nonlocal running, waiting
        queued, t_queued = sem.locked(), time.perf_counter()  # no free slot: this episode waits
        if queued:
            waiting += 1
            batch.max_queue_depth = max(batch.max_queue_depth, waiting)
        async with sem:
            if queued:
                waiting -= 1
                batch.queue_wait_s += time.perf_counter() - t_queued
            running += 1
            batch.max_inflight = max(batch.max_inflight, running)
            if gauge is not None:
                gauge.enter()
            try:
                return await run_episode(task, env, pol, tokenizer, limits, tool_parser, template_kwargs)
            finally:
                running -= 1
                if gauge is not None:
                    gauge.leave()

    t0 = time.perf_counter()
    batch.episodes = list(await asyncio.gather(*(one(t, pol) for t, pol in zip(tasks, policies))))
    batch.seconds = time.perf_counter() - t0
    return batch

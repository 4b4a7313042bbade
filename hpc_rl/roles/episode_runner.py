"""The env rank's side of a multi-turn collection (roles/episodes.py has the generator's).

For each generator it serves, the env rank runs that order's episodes concurrently against
the generator's endpoint (its address from the job's signed store, the job's endpoint key),
at most `env.agentic.max_inflight_episodes` at once per generator, through one HTTP client
whose connection pool has exactly that size. Every policy call goes through the token route
with the request's own seed (a function of the order's seed for the item and the turn), so
a resumed run samples what the first attempt would have.

What the episodes did goes back with the trajectories (agentic/figures.py): counts, errors
and timeouts by kind, in-flight peaks (per engine, and over the whole env rank), queue
depth and waits, and each policy turn's tool latency. Each kind of error the environment
raises is logged here once, with its traceback's last line (agentic/faults.py).
"""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Sequence, Tuple

from hpc_rl.messaging import p2p as exchange

from .episodes import EpisodeReturn, Episodes, endpoint_of

STAT_KEYS = ("episodes", "turns", "errors", "truncated", "siblings", "tool_parse_errors", "tool_calls", "tool_errors",
             "changed_policy_tokens",
             "policy_tokens", "env_tokens", "failed", "timeouts")
TURN_SEED_STRIDE = 1_000_003  # turn k of an item samples with seed + k * stride (mod 2^31 - 1)


def environment_kwargs(cfg, sandbox_tag: str = "local") -> Dict[str, Any]:
    """What a configured environment is built with: a verifiers environment gets its section
    (env.agentic.verifiers) and the policy's tokenizer, which verifiers renders prompts with;
    a NeMo Gym environment its section (env.agentic.gym); the python_tool environment its
    sandbox's limits (env.agentic.sandbox), the episode deadline, and the rank's sandbox tag."""
    a = cfg.env.agentic
    if a.environment == "python_tool":
        s = a.sandbox
        return {"tag": sandbox_tag, "episode_timeout_s": a.episode_timeout_s, "scoring_buffer_s": s.scoring_buffer_s,
                "wall_s": s.wall_s, "cpu_s": s.cpu_s, "memory_mb": s.memory_mb, "output_bytes": s.output_bytes,
                "kind": s.kind}
    if a.environment == "gym":
        g = a.gym
        return {"resources_server": g.resources_server, "dataset": g.dataset, "agent": g.agent, "python": g.python,
                "search_dirs": list(g.search_dirs), "args": list(g.args), "private_network": g.private_network,
                "model_name": cfg.model.name,
                "start_timeout_s": a.episode_timeout_s}
    if a.environment != "verifiers":
        return {}
    from hpc_rl.agentic.verifiers_bridge import renderer_config, renderer_name

    v = a.verifiers
    return {"taskset": v.taskset, "taskset_args": dict(v.taskset_args), "harness": v.harness, "runtime": v.runtime,
            "python": v.python, "renderer_model": cfg.model.path, "model_name": cfg.model.name,
            "renderer": renderer_config(renderer_name(v.renderer, a.tool_parser)),
            "start_timeout_s": a.episode_timeout_s}


def task_of(record) -> dict:
    """What an episode sees of a prompt record: the dataset row's fields."""
    return {"prompt": record.prompt, "answer": record.answer, "agent": record.agent, "task": record.task, "id": record.id}


class EpisodeRunner:
    def __init__(self, ctx):
        from transformers import AutoTokenizer

        from hpc_rl.agentic.contract import Limits
        from hpc_rl.agentic.environments import build_environment
        from hpc_rl.agentic.faults import ErrorLog
        from hpc_rl.serving.key import endpoint_key

        self.ctx, a = ctx, ctx.cfg.env.agentic
        self.agentic = a
        from hpc_rl.agentic.python_tool import sandbox_tag

        # the tag names the job and the env rank: a restarted rank reaps its predecessor's sandboxes
        tag = sandbox_tag(ctx.ident.job_id, ctx.ident.role_rank)
        self.episode = build_environment(a.environment, **environment_kwargs(ctx.cfg, tag))
        self.errors = ErrorLog(ctx.log, a.environment)
        self.limits = Limits(max_turns=a.max_turns, max_tokens=a.max_tokens, turn_timeout_s=a.turn_timeout_s,
                             episode_timeout_s=a.episode_timeout_s, truncated_reward=a.truncated_reward)
        # the chat template renders the environment's messages: the policy's own tokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(ctx.cfg.model.path)
        self._key = endpoint_key()  # held in memory only (docs/security.md)

    def shutdown(self) -> None:
        """At the run's end: an environment that holds outside resources (a NeMo Gym
        environment's servers and its directory) releases them; the others have nothing to do."""
        stop = getattr(self.episode, "shutdown", None)
        if callable(stop):
            stop()

    def _sandbox_stats(self) -> Dict[str, float]:
        """A sandboxing environment's (python_tool's) counts of this round, once every sandbox
        the round started has ended (an episode cut at its deadline leaves its tool call to end
        at the deadline plus the scoring buffer): none outlives its round."""
        settle, take = getattr(self.episode, "settle", None), getattr(self.episode, "take_stats", None)
        if not callable(take):
            return {}
        if callable(settle):
            settle()
        return take()

    def run(self, works: Sequence[Episodes]) -> List[Tuple[EpisodeReturn, List[Tuple[int, float, Any]]]]:
        """Every generator's episodes of this round, concurrently; per work (its trajectories
        and stats for the generator, its (index, reward, correct) for the driver)."""
        out = asyncio.run(self._run_all(works))
        tool_stats = self._sandbox_stats()
        if tool_stats:  # counted once per rank: on the first generator's figures (the driver adds them up)
            out[0][0].stats.update(tool_stats)
        lines: Dict[str, str] = {}
        counts: Dict[str, float] = {}
        for back, _ in out:
            for kind, line in back.errors.items():
                lines.setdefault(kind, line)
            for kind, v in back.stats.get("errors_by_kind", {}).items():
                counts[kind] = counts.get(kind, 0) + v
        self.errors.note(lines, counts, works[0].step if works[0].train else None)
        return out

    async def _run_all(self, works: Sequence[Episodes]):
        from hpc_rl.agentic.runner import InflightGauge

        gauge = InflightGauge()  # this rank's episodes in flight, over every engine it serves
        out = list(await asyncio.gather(*(self._run(w, gauge) for w in works)))
        for back, _ in out:
            back.stats["max_inflight_env_rank"] = float(gauge.peak)
        return out

    async def _run(self, work: Episodes, gauge):
        a, ident = self.agentic, self.ctx.ident
        url = f"http://{endpoint_of(self.ctx.store, ident.restart, work.engine)}"
        return await episodes_at(url, self._key, self.episode, self.tokenizer, self.limits, a.tool_parser, work.sampling,
                                 work.items, a.max_inflight_episodes, gauge)


async def episodes_at(url: str, key: str, episode, tokenizer, limits, tool_parser: str, sp, items,
                      max_inflight: int, gauge=None) -> Tuple[EpisodeReturn, List[Tuple[int, float, Any]]]:
    """`items` ((index, record, seed)) as episodes against the endpoint at `url`, at most
    `max_inflight` at once through one client whose pool holds as many connections:
    (trajectories and stats, (index, reward, correct) per item)."""
    from hpc_rl.agentic.runner import run_episodes
    from hpc_rl.serving.client import EndpointClient

    async with EndpointClient(url, key, max_connections=max_inflight, timeout_s=limits.turn_timeout_s) as client:

        def policy_of(seed: int):
            turn = {"k": 0}

            async def policy(prompt_ids: List[int], max_tokens: int):
                turn["k"] += 1
                out = await client.tokens(prompt_ids, max_tokens=min(max_tokens, sp.max_tokens), temperature=sp.temperature,
                                          top_p=sp.top_p, top_k=sp.top_k, stop=sp.stop,
                                          seed=(seed + turn["k"] * TURN_SEED_STRIDE) % (2 ** 31 - 1))
                return (out["token_ids"], out["logprobs"], out["weight_version_first"], out["weight_version_last"],
                        out["finish_reason"])
            return policy

        batch = await run_episodes([task_of(rec) for _, rec, _ in items], episode, [policy_of(seed) for *_, seed in items],
                                   limits, tokenizer, max_inflight, tool_parser, gauge=gauge)
    rows = [(i, trained_rows(sample_rows, tokenizer)) for (i, _, _), (sample_rows, _) in zip(items, batch)]
    scores = [(i, float(result.reward), result.correct) for (i, _, _), (_, result) in zip(items, batch)]
    m = batch.metrics()
    # figures the driver merges over the generators (agentic/figures.py merge_stats): counts,
    # peaks (max_*), counts by kind, and the latency samples themselves
    stats: Dict[str, Any] = {k: float(m[k]) for k in STAT_KEYS}
    stats.update(max_inflight_episodes=float(batch.max_inflight), max_queue_depth=float(batch.max_queue_depth),
                 queue_wait_s=batch.queue_wait_s, errors_by_kind={k: float(v) for k, v in m["errors_by_kind"].items()},
                 timeouts_by_kind={k: float(v) for k, v in m["timeouts_by_kind"].items() if v},
                 tool_latency_s=batch.tool_latencies())
    return EpisodeReturn(rows, stats, batch.error_lines()), scores


def trained_rows(rows, tokenizer):
    """The rows an episode contributes: its samples, the last (the one that holds the
    episode's end) last; an episode whose history was rewritten has earlier sibling samples
    (rl/siblings.py). An episode without a single policy token (it failed before the first
    turn) contributes an empty, fully masked response on a one-token prompt, so every
    prompt keeps its row."""
    from hpc_rl.engines.rows import SampleRow

    if rows:
        return list(rows)
    return [SampleRow([tokenizer.bos_token_id or 0], [], [], True, "", loss_mask=[], token_versions=[], turns=0)]


def serve_episodes(runner: EpisodeRunner, works: Sequence[Episodes], sources: Sequence[int], driver: int, set_phase) -> Dict[str, Any]:
    """The env rank's round of a multi-turn collection: run, return each generator's
    trajectories, then answer the driver with every reward when the order wants them."""
    out = runner.run(works)
    set_phase("wait_send")
    for src, (back, _) in zip(sources, out):
        exchange.send(back, src)
    if works[0].wanted:
        exchange.send([s for _, scores in out for s in scores], driver)
    return {"episodes": sum(len(w.items) for w in works)}

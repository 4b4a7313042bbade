"""Multi-turn collections (`env.agentic.environment`): the generator's side and the env's.

A training or evaluation collection of an agentic recipe does not sample one answer per
prompt. The generator hands the order's prompts to its env rank (`Episodes`) and serves its
engine's endpoint (hpc_rl/serving/) until the env rank sends the episodes' trajectories
back; the env rank runs the episodes concurrently against that endpoint with the job's
endpoint key, scores them, answers the driver with the rewards as single-turn verifiers do,
and returns one token-exact trajectory per prompt (hpc_rl/agentic/). The generator then
forwards the trajectories to the teachers and the driver like sampled rows: nothing
downstream of it knows a row took several turns, except that its environment tokens carry
loss mask 0 (engines/rows.py).

In-flight refits keep working: the serving loop polls for them between scheduler steps,
and every policy token carries the weight version it was sampled under.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from hpc_rl.data.dataset import PromptRecord
from hpc_rl.engines.base import Sampling
from hpc_rl.messaging import p2p as exchange

ENDPOINT_KEY = "endpoint/{restart}/{engine}"  # an engine's endpoint address, host:port (on the job's signed store)


@dataclass
class Episodes:
    """What a generator hands its env rank for one multi-turn collection."""

    engine: int  # the generator (engine index) whose endpoint serves these episodes
    wanted: bool  # the env rank answers the driver with the rewards
    step: int = 0
    train: bool = False
    items: List[Tuple[int, PromptRecord, int]] = field(default_factory=list)  # (index, record, seed)
    sampling: Optional[Sampling] = None


@dataclass
class EpisodeReturn:
    """The env rank's answer to its generator: one trajectory per item, and what happened."""

    rows: List[Tuple[int, List[Any]]]  # (index, its SampleRows: earlier siblings first, the episode's end last)
    stats: Dict[str, Any] = field(default_factory=dict)  # agentic/figures.py
    errors: Dict[str, str] = field(default_factory=dict)  # error kind -> a traceback line (the env rank logs it)


class EngineEndpoint:
    """The engine leader's endpoint: started with the engine, serving during an order."""

    def __init__(self, ctx, engine, index: int):
        from vllm.utils.network_utils import get_ip

        from hpc_rl.serving import RequestQueue, endpoint_key, start_endpoint

        self.ctx, self.engine, self.index = ctx, engine, index
        self.requests = RequestQueue()
        a = ctx.cfg.env.agentic
        self.server = start_endpoint(get_ip(), engine.tokenizer, self.requests.submit, endpoint_key(),
                                     tool_parser=a.tool_parser, model_name=ctx.cfg.model.path)
        ctx.store.set(ENDPOINT_KEY.format(restart=ctx.ident.restart, engine=index), f"{self.server.host}:{self.server.port}")
        ctx.log.info("engine %d serves its endpoint at http://%s:%d/v1 (the job's key required)", index,
                     self.server.host, self.server.port)

    def collect(self, order, env_rank: int, between_steps) -> Tuple[List[Any], Dict[str, Any]]:
        """Hand the order's items to the env rank, serve the engine until its trajectories
        come back; returns each item's rows (siblings first, its last sample last) in the
        order's item order, and the episodes' stats."""
        exchange.send(Episodes(self.index, order.score_env, order.step, order.train, order.items, order.sampling), env_rank)
        box: List[Any] = []

        def wait_for_env():
            try:
                box.append(exchange.recv(env_rank))
            except BaseException as exc:  # surfaced in the generator's thread below
                box.append(exc)

        waiter = threading.Thread(target=wait_for_env, name="episodes-reply", daemon=True)
        waiter.start()
        served = self.engine.serve(self.requests, until=lambda: not waiter.is_alive(), between_steps=between_steps)
        waiter.join()
        if isinstance(box[0], BaseException):
            raise RuntimeError(f"env rank {env_rank} did not return the episodes of step {order.step}: {box[0]}") from box[0]
        back: EpisodeReturn = box[0]
        rows = dict(back.rows)
        stamp_unsampled(rows.values(), self.engine.weight_version)
        stats = dict(back.stats, engine_max_batch=float(served.max_batch), engine_steps=float(served.steps),
                     engine_step_s=served.step_s, engine_idle_s=served.idle_s, engine_wall_s=served.wall_s)
        return [rows[i] for i, _, _ in order.items], stats

    def close(self) -> None:
        self.server.stop()


def stamp_unsampled(groups, version: int) -> None:
    """An episode that failed before its first turn sampled nothing: its placeholder row
    (episode_runner.trained_rows) is as old as the weights the engine serves when the
    trajectories come back, not version 0, which the age bound would read as a sample
    `step - 1` steps old."""
    for group in groups:
        for row in group:
            if not row.response_ids:
                row.version_first = row.version_last = version


def endpoint_of(store, restart: int, engine: int) -> str:
    """Blocks (the store's timeout) until engine `engine` has published its endpoint."""
    return store.get(ENDPOINT_KEY.format(restart=restart, engine=engine)).decode()

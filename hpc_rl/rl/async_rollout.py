"""Asynchronous rollouts (`algo.async_rollout.enabled`): the generators sample step k+1
while the trainer ranks train step k, one order ahead, on the routed exchange.

Step k on the trainer ranks:
  1. gather k   unless the rollout buffer holds it: the driver receives the rows and every
                scorer's answer of the outstanding order k; then every trainer rank sends the
                refit order k asked for (the newest weights, those of step k-1: the train step
                of k has not started). The generator receives it right after forwarding.
  2. order k+1  the driver draws the next prompts and orders them with `refit_after=k`.
  3. batch k    the buffer's collection, shared in the trainer group, minus samples older
                than `max_trajectory_age_steps` (whole prompt groups, counted).
With dynamic sampling (rl/dynamic_sampling.py) step k's groups of one reward are dropped and
the step is topped up by fresh collections between 1 and 2 (`_top_up`).
The generator thus samples k+1 with the weights of step k-1 while the trainer trains k:
each sample is one step old when it is trained on, and the generator's refit waits only for
the gather, not for a train step.

Checkpoints: before a save (periodic, or a stop for a requeue) the outstanding order is
gathered and its refit sent, so the buffer holds every collected, untrained step and the
generators hold nothing; the buffer is saved with the checkpoint (each trainer rank's extra
state) and a resume trains exactly those rows: nothing lost, nothing sampled twice, and the
run's weights equal an uninterrupted run's.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Union

from hpc_rl.messaging import p2p as exchange
from hpc_rl.messaging.messages import COLLECT, IN_FLIGHT_KEY, Batch, request_seed

from .dynamic_sampling import DynamicSamplingError, TopUps, settle
from .staleness import drop_stale


class AsyncRollouts:
    def __init__(self, ctx, collector, trainer, sampling, it, stream: int, distill: bool):
        self.ctx, self.cfg, self.collector, self.trainer = ctx, ctx.cfg, collector, trainer
        self.sampling, self.it, self.stream, self.distill = sampling, it, stream, distill
        self.driver = collector.is_driver
        self.bound = self.cfg.algo.async_rollout.max_trajectory_age_steps
        self.in_flight = self.cfg.algo.async_rollout.in_flight_weight_updates
        # Every trainer rank tracks the same control state (it decides who joins a refit);
        # the collections themselves live on the driver.
        self.ready: List[int] = []  # collected, untrained steps (the buffer's positions)
        self.buffer: Dict[int, Dict[str, Any]] = {}  # driver: step -> gathered collection
        self.outstanding: Optional[Dict[str, Any]] = None  # the order the generators work on
        self.refit_s = 0.0
        self.wait_s = 0.0  # the driver's time blocked on the generators and scorers
        # dynamic sampling's extra collections of a step (rl/dynamic_sampling.py), drawn from the same iterator
        self.topups = TopUps(self.cfg, collector, it, sampling, stream, distill) \
            if self.cfg.algo.dynamic_sampling.enabled else None

    # --------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> Dict[str, Any]:
        assert self.outstanding is None, "drain() before saving: the generators' work is not in the buffer"
        return {"ready": list(self.ready), "buffer": dict(self.buffer)}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        state = state or {}
        self.ready = list(state.get("ready", []))
        self.buffer = dict(state.get("buffer", {})) if self.driver else {}

    # ---------------------------------------------------------------------------- the step
    def next_batch(self, step: int, why: Optional[str]) -> Union[Batch, str]:
        """Step `step`'s batch, or the driver's reason to stop (every trainer rank gets it)
        once the outstanding order is in the buffer."""
        why = exchange.share(why, self.collector.routes.driver, self.collector.group)
        self.refit_s = self.wait_s = 0.0
        if step not in self.ready:
            if self.outstanding is None:
                if why:
                    return why
                self._order(step, refit_after=None)  # the first step, or a resume with an empty buffer
            self._gather()
        if why:
            return why
        gathered = self.buffer.pop(step) if self.driver else None
        self.ready.remove(step)
        dropped = 0
        if self.driver:
            gathered, dropped = drop_stale(gathered, policy_version=step - 1, bound=self.bound,
                                           group_size=self.cfg.algo.generations_per_prompt)
        topped = self._top_up(gathered, step) if self.topups else None
        if topped:
            gathered, ds = topped
        if step + 1 <= self.cfg.run.max_steps:  # in flight: step's weights land mid-sampling, sent by after_train
            self._order(step + 1, refit_after=None if self.in_flight else step, in_flight=step if self.in_flight else None)
        depth = len(self.ready) + (self.outstanding is not None)  # steps collected or sampling ahead of this one
        batch = self.collector.batch_of(gathered)
        dropped = exchange.share(dropped, self.collector.routes.driver, self.collector.group)
        batch.info["async"] = {"buffer_depth": depth, "stale_dropped": dropped}
        if topped:
            batch.info.update(ds)
        batch.timing = {"wait_rows_s": self.wait_s, "refit_s": self.refit_s,
                        "generate_busy_s": gathered["generate_busy_s"] if self.driver else 0.0}
        return batch

    def after_train(self, step: int) -> float:
        """In-flight weight updates: right after train step `step`, send its weights to the
        generators sampling step + 1 (announced on the store: they load them between
        scheduler steps, or after sampling). Returns the send's seconds."""
        o = self.outstanding
        if o is None or o["in_flight"] != step:
            return 0.0
        if self.driver:
            self.ctx.store.set(IN_FLIGHT_KEY.format(restart=self.ctx.ident.restart, version=step), "1")
        self.ctx.set_phase("refit")
        o["in_flight"] = None
        return self.trainer.refit()

    def drain(self) -> None:
        """Before a save: the outstanding order into the buffer (and its refit sent)."""
        if self.outstanding is not None:
            self._gather()

    # ------------------------------------------------------------------------------ pieces
    def _top_up(self, gathered, step: int):
        """Dynamic sampling (rl/dynamic_sampling.py): the buffer's collection, its groups of
        one reward dropped, topped up by fresh collections until it holds prompts_per_step
        groups. Run before step + 1 is ordered: the generators hold the newest weights (the
        refit of this step's gather has been sent) and have nothing queued, so a top-up is
        sampled at once, by the current policy (age 0: within the bound). The trainer ranks
        wait meanwhile (counted in wait_rows_s): the overlap is lost only on steps that need
        a top-up. Returns (the collection on the driver, None elsewhere; the step's figures)."""
        t0 = time.perf_counter()
        outcome = None
        if self.driver:
            self.ctx.set_phase("wait_rows")
            try:
                gathered, stats = self.topups.fill(gathered, step)
                outcome = ("ok", stats)
            except DynamicSamplingError as e:
                outcome = ("error", str(e))
        stats = settle(self.collector, outcome)[1]
        self.wait_s += time.perf_counter() - t0
        return gathered, stats

    def _order(self, step: int, refit_after: Optional[int], in_flight: Optional[int] = None) -> None:
        records = None
        if self.driver:
            n = self.cfg.algo.generations_per_prompt
            records = [r for r in next(self.it) for _ in range(n)]
            seeds = {i: request_seed(self.cfg.run.seed, self.stream, step, i) for i in range(len(records))}
            self.collector.order(COLLECT, step, records, seeds=seeds, sampling=self.sampling, score_env=True,
                                 score_teachers=self.distill, train=True, refit_after=refit_after,
                                 refit_in_flight=in_flight)
        self.outstanding = {"step": step, "records": records, "refit": refit_after is not None, "in_flight": in_flight}

    def _gather(self) -> None:
        o = self.outstanding
        # the generators send their rows only once they hold the in-flight weights: after_train first
        assert o["in_flight"] is None, f"step {o['step']}: gathered before its in-flight refit was sent"
        t0 = time.perf_counter()
        if self.driver:
            self.ctx.set_phase("wait_rows")
            self.buffer[o["step"]] = self.collector.gather(o["records"], score_env=True, score_teachers=self.distill)
        self.wait_s += time.perf_counter() - t0
        self.ready.append(o["step"])
        self.outstanding = None
        if o["refit"]:  # the generators wait for it right after forwarding their rows
            self.ctx.set_phase("refit")
            self.refit_s += self.trainer.refit()

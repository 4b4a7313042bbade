"""DAPO's dynamic sampling (`algo.dynamic_sampling`, GRPO) and the step's batch.

A prompt group whose samples all earned one reward has zero advantage: it costs a forward
and a backward and trains nothing, and a batch of fewer useful groups gives noisier
gradients. With dynamic sampling such groups are dropped and further collections (the next
prompts of the PromptIterator, fresh seeds) top the step up until it holds
`algo.prompts_per_step` groups that carry a signal; the surplus of the last collection is
dropped, its first groups kept in order. So every trained batch has its configured size
and no zero-advantage group (DAPO, arXiv 2503.14476, sec. 3.2; NeMo RL's
`use_dynamic_sampling`). After `max_collections` collections a step still short fails with
what it saw: silently training a smaller batch would change the optimizer's step size.

Lock-step (`LockStep`): the driver orders each collection without `refit_after` (the
generators would otherwise wait for this step's weights before sampling the top-up) and,
once the step is complete, orders the refit the loop sends after training (`REFIT`), which
the generators wait for exactly as they would after a training collection.
Asynchronous rollouts (rl/async_rollout.py): the buffer's collection of step k, minus its
stale groups, is topped up right after it was gathered and before step k+1 is ordered:
the generators then hold the newest weights and have nothing queued, so the top-ups are
fresh (age 0, within any bound) and the pipeline order of the orders is kept.
Either way the prompts of every collection are drawn from the iterator on the driver
before the step trains, so a checkpoint saved after the step holds an iterator past them:
a resume neither repeats nor skips prompts.

Each collection c of a step (c = 0 the first) samples with seeds of its own stream, so a
prompt drawn again in a top-up (a small dataset's next epoch) is not the same sample.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from hpc_rl.messaging import p2p as exchange
from hpc_rl.messaging.messages import COLLECT, REFIT, Batch, request_seed

from .batch_ops import Gathered, concat, group_rewards, select_groups, signal_groups
from .staleness import drop_stale

# Seed streams of the top-up collections: stream TOPUP_STREAM + c for the step's c-th extra
# collection (training uses 1, the evaluations 2 and 3: rl/loop.py, rl/eval.py).
TOPUP_STREAM = 16


class DynamicSamplingError(RuntimeError):
    pass


def topup_stream(stream: int, c: int) -> int:
    """The seed stream of a step's collection c (0: the step's own `stream`)."""
    return stream if c == 0 else TOPUP_STREAM + c


def fill(first: Gathered, step: int, cfg, more: Callable[[int], Gathered]) -> Tuple[Gathered, Dict[str, Any]]:
    """Driver: `first` (the step's collection) topped up by `more(c)` (collection c >= 1)
    until it holds algo.prompts_per_step groups whose rewards differ; returns them (the
    first of each collection, in order) and the step's figures. Raises DynamicSamplingError
    after algo.dynamic_sampling.max_collections collections."""
    a = cfg.algo
    n, want, cap = a.generations_per_prompt, a.prompts_per_step, a.dynamic_sampling.max_collections
    shaping, max_tokens = a.overlong_shaping, cfg.generator.sampling.max_tokens
    parts: List[Gathered] = []
    kept = sampled = surplus = 0
    uniform: Counter = Counter()  # the reward of each dropped group: too easy or too hard?
    rewards_all: List[float] = []
    gathered, c = first, 0
    while True:
        groups = group_rewards(gathered, n, shaping, max_tokens)
        good = signal_groups(groups)
        uniform.update(rs[0] for g, rs in enumerate(groups) if max(rs) == min(rs))
        rewards_all += [float(r) for r in gathered["rewards"]]
        take = good[:want - kept]
        sampled, surplus, kept = sampled + len(groups), surplus + len(good) - len(take), kept + len(take)
        parts.append(select_groups(gathered, take, n))
        c += 1
        if kept == want:
            break
        if c >= cap:
            seen = ", ".join(f"{v:g}: {k}" for v, k in sorted(uniform.items()))
            raise DynamicSamplingError(
                f"step {step}: dynamic sampling found {kept} of algo.prompts_per_step={want} prompt groups whose "
                f"rewards differ in algo.dynamic_sampling.max_collections={cap} collections ({sampled} groups of "
                f"{n} sampled; the others earned one reward per group, groups by that reward: {{{seen}}}). "
                f"Fix: raise algo.dynamic_sampling.max_collections, or algo.generations_per_prompt (a larger group "
                f"more often holds differing rewards), or train on data of another difficulty (groups all "
                f"rewarded: harder prompts; none rewarded: easier ones)")
        gathered = more(c)
    stats = {"dynamic_sampling/collections": c, "dynamic_sampling/groups_sampled": sampled,
             "dynamic_sampling/groups_dropped": sampled - kept - surplus, "dynamic_sampling/groups_surplus": surplus,
             "dynamic_sampling/groups_kept": kept,
             # the policy's reward over everything sampled (the trained batch's reward_mean is biased by the filter)
             "dynamic_sampling/reward_mean_sampled": sum(rewards_all) / max(len(rewards_all), 1)}
    return concat(parts), stats


class TopUps:
    """The driver's extra collections of a step: the next prompts, a stream of seeds per
    collection, no refit after them (`fill`'s `more`)."""

    def __init__(self, cfg, collector, it, sampling, stream: int, distill: bool):
        self.cfg, self.collector, self.it, self.sampling = cfg, collector, it, sampling
        self.stream, self.distill = stream, distill
        self.bound = cfg.algo.async_rollout.max_trajectory_age_steps

    def collection(self, step: int, c: int) -> Gathered:
        n = self.cfg.algo.generations_per_prompt
        records = [r for r in next(self.it) for _ in range(n)]
        seeds = {i: request_seed(self.cfg.run.seed, topup_stream(self.stream, c), step, i) for i in range(len(records))}
        self.collector.order(COLLECT, step, records, seeds=seeds, sampling=self.sampling, score_env=True,
                             score_teachers=self.distill, train=True)
        gathered = self.collector.gather(records, score_env=True, score_teachers=self.distill)
        # sampled by the newest weights (age 0): the bound holds; checked as every collection is
        gathered, _ = drop_stale(gathered, policy_version=step - 1, bound=self.bound, group_size=n)
        return gathered

    def fill(self, first: Gathered, step: int) -> Tuple[Gathered, Dict[str, Any]]:
        return fill(first, step, self.cfg, lambda c: self.collection(step, c))


def settle(collector, outcome) -> Any:
    """Every trainer rank: the driver's outcome (its figures, or the reason it stopped or
    failed) shared in the trainer group; a failure raises on every rank, with its words."""
    outcome = exchange.share(outcome, collector.routes.driver, collector.group)
    if outcome[0] == "error":
        raise DynamicSamplingError(outcome[1])
    return outcome


class LockStep:
    """Dynamic sampling without asynchronous rollouts (see the module's docstring)."""

    def __init__(self, cfg, collector, it, sampling, stream: int, distill: bool):
        self.cfg, self.collector, self.it, self.sampling = cfg, collector, it, sampling
        self.stream, self.distill = stream, distill
        self.topups = TopUps(cfg, collector, it, sampling, stream, distill)

    def next_batch(self, step: int, why: Optional[str]) -> Union[Batch, str]:
        t0 = time.perf_counter()
        gathered, outcome = None, None
        if self.collector.is_driver:
            if why:  # no prompts are drawn for a step that stops: the saved iterator must not skip them
                outcome = ("stop", why)
            else:
                try:
                    gathered, stats = self.topups.fill(self.topups.collection(step, 0), step)
                    # the loop sends this step's weights after training: the generators wait for them now
                    self.collector.order(REFIT, step, [])
                    outcome = ("ok", stats)
                except DynamicSamplingError as e:
                    outcome = ("error", str(e))
        outcome = settle(self.collector, outcome)
        if outcome[0] == "stop":
            return outcome[1]
        t_rows = time.perf_counter()
        # the step's collections were all sampled by the weights it trains from (no refit between
        # them): its training forward may give the old log-probs, as one collection's would
        batch = self.collector.batch_of(gathered, trains_from=step - 1)
        batch.info.update(outcome[1])
        # generate_s: every collection's sampling and scoring; logprobs_s: the one pass over the kept rows (0 when skipped)
        batch.timing = {"generate_s": t_rows - t0, "logprobs_s": time.perf_counter() - t_rows}
        return batch


def step_batch(pipeline, collector, it, sampling, stream: int, step: int, why: Optional[str],
               distill: bool) -> Union[Batch, str]:
    """The trainer ranks' batch of a training step (rl/loop.py), or the driver's reason to
    stop: asynchronous rollouts' (dynamic sampling inside), dynamic sampling's in lock-step,
    or one plain collection."""
    cfg = collector.ctx.cfg
    if pipeline:  # the batch was sampled while the previous step trained
        return pipeline.next_batch(step, why)
    if cfg.algo.dynamic_sampling.enabled:
        return LockStep(cfg, collector, it, sampling, stream, distill).next_batch(step, why)
    # no prompts are drawn for a step that stops: the saved iterator must not skip them
    records = [r for r in next(it) for _ in range(cfg.algo.generations_per_prompt)] \
        if collector.is_driver and not why else None
    return collector.collect(records, sampling, stream, step, score_env=True, score_teachers=distill, train=True,
                             stop=why)

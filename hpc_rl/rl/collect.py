"""One collection, as the trainer ranks run it: the driver orders every generator to
sample its share, gathers the rows, the trainer ranks compute the student's log-probs
(unless the train step's forward gives them: roles/old_logprobs.py) while env ranks and
teacher groups score, and the scores come back to the driver.
Every trainer rank returns the same `Batch`."""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Union

import torch

from hpc_rl.agentic.figures import finish_stats, merge_stats
from hpc_rl.config.resources import REFERENCE
from hpc_rl.data.dataset import PromptRecord
from hpc_rl.engines.base import Sampling
from hpc_rl.refit.vllm_engine import pad_rows

from hpc_rl.messaging import p2p as exchange
from hpc_rl.messaging.messages import COLLECT, TEACHER_EVAL, Batch, Order, request_seed
from hpc_rl.messaging.routes import Routes

from . import siblings


class Collector:
    def __init__(self, ctx, routes: Routes, trainer, router, pad_id: int):
        self.ctx, self.routes, self.trainer, self.router, self.pad_id = ctx, routes, trainer, router, pad_id
        self.is_driver = ctx.ident.global_rank == routes.driver
        self.group = ctx.groups.role
        # the teacher group that serves the reference model (algo.ref_kl_coef > 0): it scores every
        # row of a training collection (config/resources.py teacher_groups)
        self.ref_group = router.group_of(REFERENCE) if router is not None and REFERENCE in router.checkpoints else None

    def order(self, kind: str, step: int, records: List[PromptRecord], **fields) -> None:
        """Driver: each generator gets its strided share of `records` (one message each)."""
        g_n = len(self.routes.generators)
        for g, rank in enumerate(self.routes.generators):
            mine = exchange.strided(len(records), g, g_n)
            items = [(i, records[i], fields.get("seeds", {}).get(i, 0)) for i in mine]
            # a training collection is scored by the reference model too (its rows train against it)
            exchange.send(Order(kind, step, items, fields.get("sampling"), fields.get("score_env", False),
                                fields.get("score_teachers", False), self._score_reference(kind, fields.get("train", False)),
                                fields.get("train", False), fields.get("refit_after"), fields.get("refit_in_flight")),
                          rank)

    def _score_reference(self, kind: str, train: bool) -> bool:
        return kind == COLLECT and train and self.ref_group is not None

    def collect(self, records: Optional[List[PromptRecord]], sampling: Sampling, stream: int, step: int,
                score_env: bool, score_teachers: bool, train: bool = False,
                stop: Optional[str] = None) -> Union[Batch, str]:
        """`records` on the driver (None on the other trainer ranks). A training collection
        is followed by a refit, which the generators then expect without another order.
        With `stop` (the driver's reason to stop for a requeue) nothing is collected: every
        trainer rank returns the reason, which travels in the share that carries the rows."""
        cfg, r = self.ctx.cfg, self.routes
        score_env = score_env and bool(r.envs)
        score_teachers = score_teachers and bool(r.teachers)
        t0 = time.perf_counter()
        self.ctx.set_phase("wait_rows")  # the driver orders and gathers; the others wait for its share
        head = None
        if self.is_driver and stop:
            head = ("stop", stop)
        elif self.is_driver:
            seeds = {i: request_seed(cfg.run.seed, stream, step, i) for i in range(len(records))}
            self.order(COLLECT, step, records, seeds=seeds, sampling=sampling, score_env=score_env,
                       score_teachers=score_teachers, train=train, refit_after=step if train else None)
            rows, versions, _, episodes, sibs = self.gather_rows(len(records))
            n_items = len(records)
            records, rows, sibling_of, sibling_index = siblings.expand(records, rows, sibs)
            head = ("rows", records, rows, versions, episodes, sibling_of)
        head = exchange.share(head, r.driver, self.group)
        if head[0] == "stop":
            return head[1]
        _, records, rows, versions, episodes, sibling_of = head
        t_gen = time.perf_counter()
        batch = Batch(records, rows, pad_rows(rows, self.pad_id), versions, sibling_of=sibling_of)
        if episodes:
            batch.info["agentic"] = episodes
        # a training batch trained in one optimizer step from the weights that sampled it takes
        # its old log-probs from the training forward (roles/old_logprobs.py): no pass here
        t_lp = time.perf_counter()
        if not train or self.trainer.old_logprobs_reason(rows, step - 1) is not None:
            self.ctx.set_phase("logprobs")
            batch.student_logprobs = self.trainer.student_logprobs(rows)
        logprobs_s = time.perf_counter() - t_lp
        self.ctx.set_phase("wait_scores")  # env ranks and teacher groups answer the driver
        scores = None
        if self.is_driver:
            rewards, correct, teacher, ref = self._scores(n_items, score_env, score_teachers,
                                                          self._score_reference(COLLECT, train))
            scores = siblings.expand_scores(rewards, correct, teacher, sibling_of, sibling_index) + \
                (siblings.expand_scores(None, None, ref, sibling_of, sibling_index)[2],)
        rewards, correct, teacher, ref = exchange.share(scores, r.driver, self.group)
        self._set_scores(batch, rewards, correct, teacher, ref)
        # score_s: from the rows to the scores, the separate pass (logprobs_s, 0 when skipped) included
        batch.timing = {"generate_s": t_gen - t0, "score_s": time.perf_counter() - t_gen, "logprobs_s": logprobs_s}
        return batch

    def gather_rows(self, n: int):
        """Driver: every generator's rows of the outstanding collection, in request order;
        the engines' versions, their sampling seconds, and (multi-turn collections) the
        episodes' figures merged over the generators (agentic/figures.py) and the sibling
        samples of rewritten histories ((index, k), row) (rl/siblings.py)."""
        rows: List = [None] * n
        versions, gen_s, episodes, sibs = set(), [], {}, []
        for rank in self.routes.generators:
            version, piece, seconds, stats = exchange.recv(rank)
            versions.add(version)
            gen_s.append(seconds)
            mine, theirs = siblings.split(piece)
            for i, row in mine:
                rows[i] = row
            sibs += theirs
            episodes = merge_stats(episodes, stats)
        a = self.ctx.cfg.env.agentic
        episodes = finish_stats(episodes, a.max_inflight_episodes, a.max_error_share)
        return rows, sorted(versions), gen_s, episodes, sibs

    def gather(self, records: List[PromptRecord], score_env: bool, score_teachers: bool):
        """Driver, asynchronous rollouts: the whole outstanding collection (rows and every
        scorer's answer) as plain data the rollout buffer keeps and a checkpoint saves."""
        rows, versions, gen_s, episodes, sibs = self.gather_rows(len(records))
        score_env, score_teachers = score_env and bool(self.routes.envs), score_teachers and bool(self.routes.teachers)
        # the asynchronous rollouts gather training collections only: the reference scores them too
        rewards, correct, teacher, ref = self._scores(len(rows), score_env, score_teachers,
                                                      self._score_reference(COLLECT, True))
        return {"records": records, "rows": rows, "versions": versions, "rewards": rewards, "correct": correct,
                "teacher": teacher, "reference": ref, "generate_busy_s": max(gen_s) if gen_s else 0.0,
                "agentic": episodes, "siblings": sibs}

    def batch_of(self, gathered, trains_from: Optional[int] = None) -> Batch:
        """Every trainer rank: the Batch of a gathered collection (the driver's, shared in
        the trainer group), with the student's log-probs, unless the batch trains from the
        weights of version `trains_from` and its training forward gives them (roles/old_logprobs.py)."""
        g = exchange.share(gathered, self.routes.driver, self.group)
        records, rows, sibling_of, index = siblings.expand(g["records"], g["rows"], g.get("siblings", []))
        rewards, correct, teacher = siblings.expand_scores(g["rewards"], g["correct"], g["teacher"], sibling_of, index)
        ref = siblings.expand_scores(None, None, g.get("reference"), sibling_of, index)[2]
        batch = Batch(records, rows, pad_rows(rows, self.pad_id), g["versions"], sibling_of=sibling_of)
        if g.get("agentic"):
            batch.info["agentic"] = g["agentic"]
        if trains_from is None or self.trainer.old_logprobs_reason(rows, trains_from) is not None:
            self.ctx.set_phase("logprobs")
            batch.student_logprobs = self.trainer.student_logprobs(rows)
        self._set_scores(batch, rewards, correct, teacher, ref)
        return batch

    def _set_scores(self, batch: Batch, rewards, correct, teacher, ref) -> None:
        if rewards is not None:
            batch.rewards, batch.correct = torch.tensor(rewards, dtype=torch.float32), correct
        if teacher is not None:
            batch.set_teacher_scores(teacher, [self.router.route(x.agent) for x in batch.records])
        if ref is not None:
            batch.set_reference_scores(ref)

    def _scores(self, n: int, score_env: bool, score_teachers: bool, score_reference: bool = False):
        """Driver: the env ranks' rewards, the teacher heads' log-probs (in route order) and the
        reference model's for every row (its group answers (the keys routed to it, every row's))."""
        rewards = correct = teacher = ref = None
        if score_env:
            rewards, correct = [0.0] * n, [None] * n
            for e in self.routes.envs:
                if self.routes.generators_of_env(e):
                    for i, reward, ok in exchange.recv(e):
                        rewards[i], correct[i] = reward, ok
        if score_teachers:
            teacher = {}
        for group in self.routes.teachers:
            if score_reference and group == self.ref_group:  # one set of log-probs serves both
                keys, ref = exchange.recv(self.routes.teacher_head(group))
                routed = {k: ref[k] for k in keys}
            elif score_teachers:
                routed = exchange.recv(self.routes.teacher_head(group))
            else:
                continue
            if score_teachers:
                teacher.update(routed)
        return rewards, correct, teacher, ref

    def teacher_accuracy(self, records: List[PromptRecord]) -> Dict[str, float]:
        """Driver only: each teacher group answers the eval prompts routed to it greedily;
        agent -> accuracy over the groups."""
        self.order(TEACHER_EVAL, 0, records)
        merged: Dict[str, List[bool]] = {}
        for group in self.routes.teachers:
            for k, v in exchange.recv(self.routes.teacher_head(group)).items():
                merged.setdefault(k, []).extend(v)
        return {k: sum(v) / len(v) for k, v in merged.items()}

"""A teacher group: an inference-only backend over the group's ranks. Its head rank
receives from every generator the rows routed to this group, shares them inside the group
(every rank of a sharded backend computes), and sends the sampled tokens' log-probs (or,
at the start, the teacher's own greedy accuracy) to the driver."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from hpc_rl.algo.routing import RoutingError, TeacherRouter
from hpc_rl.config.resources import group_config
from hpc_rl.envs.registry import score
from hpc_rl.models.assets import chat_prompt
from hpc_rl.models.backend import BackendSpec, parallel_sizes
from hpc_rl.models.registry import build_backend
from hpc_rl.refit.vllm_engine import pad_rows
from hpc_rl.messaging import p2p as exchange
from hpc_rl.messaging.messages import END, STOP, TEACHER_EVAL, Work
from hpc_rl.messaging.routes import Routes
from hpc_rl.runtime.faults import maybe_inject


class TeacherRole:
    def __init__(self, ctx, routes: Routes, group: str, tokenizer):
        cfg = ctx.cfg
        self.ctx, self.routes, self.group, self.tok = ctx, routes, group, tokenizer
        self.head = routes.teacher_head(group)
        self.is_head = ctx.ident.global_rank == self.head
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # a teacher's section, or the reference model's (config/resources.py teacher_groups)
        t = group_config(cfg, group)
        self.max_tokens = cfg.generator.sampling.max_tokens
        # inference only, with the teacher's own parallel sizes (every rank scores all rows)
        checkpoint = t.checkpoint or cfg.model.path  # the reference model's default: the student's start
        precision = t.precision or cfg.trainer.precision  # the reference's default: the student's
        # the teachers run trainer.backend with the trainer's log-prob chunking, token budget and packing
        self.backend = build_backend(cfg.trainer.backend, BackendSpec(
            checkpoint, precision, ctx.device, ctx.groups.role, parallel=parallel_sizes(t.parallel),
            logprob_chunk_tokens=cfg.trainer.logprob_chunk_tokens, logprob_batch_tokens=cfg.trainer.logprob_batch_tokens,
            packing=cfg.trainer.packing, attn_implementation=cfg.trainer.attn_implementation))
        self.router = router = TeacherRouter.from_config(cfg)
        ctx.log.info("teacher group %s (aliases %s) loaded from %s (%s backend)", group,
                     [a for a in router.checkpoints if router.group_of(a) == group], checkpoint, cfg.trainer.backend)

    def serve(self) -> Dict[str, Any]:
        done: Dict[str, Any] = {"role": f"teacher/{self.group}", "rank": self.ctx.ident.role_rank, "rounds": 0,
                                "steps": 0}
        while True:
            work = None
            self.ctx.set_phase("wait")  # for the generators' rows (the head), then the group's share
            if self.is_head:
                parts: List[Work] = [exchange.recv(g) for g in self.routes.generators]
                first = parts[0]
                work = Work(first.kind, first.wanted, first.step, first.train, [it for p in parts for it in p.items],
                            reference=first.reference)
            work = exchange.share(work, self.head, self.ctx.groups.role)
            done["rounds"] += 1
            busy = "eval" if work.kind == TEACHER_EVAL or not work.train else "score"
            self.ctx.set_phase(busy if work.wanted else "wait", work.step if work.train else None)
            if work.train:
                done["steps"] += 1
                exchange.mark_step(work.step)
                ident = self.ctx.ident
                maybe_inject(self.ctx.cfg.ft.inject_failure, ident.role, ident.role_rank, ident.restart, work.step)
            if work.kind == STOP:
                return dict(done, stopped=True)
            if work.kind == END:
                return done
            if not work.wanted:
                continue
            out = self.accuracy(work.items) if work.kind == TEACHER_EVAL else self.score(work.items)
            if work.reference:  # every row's, for the reference; the keys of those routed here as a teacher
                out = ([k for k, rec, _ in work.items if self._routed_here(rec.agent)], out)
            if self.is_head:
                self.ctx.set_phase("wait_send")  # the send returns once the driver takes it
                exchange.send(out, self.routes.driver)

    def _routed_here(self, agent: str) -> bool:
        """Whether this group scores `agent`'s samples as a teacher (a group serving only the
        reference model routes none; an agent no teacher takes is no error here)."""
        try:
            return self.router.group_of(self.router.route(agent)) == self.group
        except RoutingError:
            return False

    def score(self, items) -> Dict[int, List[float]]:
        """Log-probs of the sampled tokens under this teacher, by sample index."""
        if not items:
            return {}
        sub = pad_rows([row for _, _, row in items], self.pad_id)
        lp = self.backend.logprobs(sub.input_ids, sub.attention_mask).float().cpu()
        return {i: lp[j, p:p + g].tolist() for j, ((i, _, _), p, g) in
                enumerate(zip(items, sub.prompt_lengths, sub.generation_lengths))}

    def accuracy(self, items) -> Dict[str, List[bool]]:
        """Greedy answers to the routed eval prompts, verified: agent -> correct per prompt."""
        mine = [rec for _, rec, _ in items if rec.task is not None and isinstance(rec.prompt, str)]
        if not mine:
            return {}
        prompts = [chat_prompt(self.tok, r.prompt) for r in mine]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # left-padded: answers append right
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        out = self.backend.greedy(ids, attn, self.max_tokens, self.tok.eos_token_id, self.pad_id)
        by: Dict[str, List[bool]] = {}
        for r, row in zip(mine, out):
            text = self.tok.decode(row, skip_special_tokens=True)
            by.setdefault(r.agent, []).append(bool(score(r.task, text, r.answer).correct))
        return by

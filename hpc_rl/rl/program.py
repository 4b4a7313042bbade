"""`run.program=rl`: the synchronous RL / MOPD loop across the job's roles.

Every rank of every role runs this same loop in lock step; the world group carries the
step's small data (prompts, sampled rows, scores) as object broadcasts, in an order fixed
by the plan, so no rank ever waits on a message nobody sends.

One step:
  1. prompts   trainer rank 0 draws the batch (each prompt repeated generations_per_prompt
               times, consecutively) and shares it.
  2. generate  each generator rank samples its round-robin share on its vLLM engine.
  3. score     at the same time: env ranks verify answers (rewards, accuracy), each teacher
               group scores the samples routed to it (logprobs of the sampled tokens; each
               sample by exactly one teacher), trainer ranks recompute the student's
               logprobs (the PPO "old" policy, and the check of vLLM's logprobs).
  4. train     trainer ranks: advantages (MOPD: teacher - student per token; GRPO: group-
               normalised rewards), mismatch weights, one optimizer step per minibatch.
  5. refit     trainer -> every generator engine, full state over the refit group.
Trainer rank 0 records metrics, rollouts and progress; checkpoints every
checkpoint.every_steps; the run resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from hpc_rl.algo import (grpo_advantages, importance_weights, masked_mean, opd_advantages, per_token, policy_loss,
                         reverse_kl_per_teacher, sequence_keep_mask, token_mult_prob_error)
from hpc_rl.algo.routing import TeacherRouter
from hpc_rl.data.dataset import PromptIterator, PromptRecord
from hpc_rl.refit.vllm_engine import Rollouts, SampleRow, pad_rows
from hpc_rl.runtime.faults import maybe_inject
from hpc_rl.runtime.identity import role_offsets

from .exchange import gather_all, interleave, share, strided
from .inputs import eval_records, load_dataset
from .records import MetricsLog, Progress, RolloutStore, summarize

SAVE_REQUEST = ".save_request.{restart}"  # touched by the batch shell's USR1 trap
STOPPED = "stopped.{restart}.json"  # the ranks saved and stopped on request: requeue, do not fail
RESTARTS = "restarts.jsonl"  # one line per resume: from which step, how many steps recomputed

TRAINER_SEED_SPACE = 1_000_003


def _seed(run_seed: int, stream: int, step: int, index: int) -> int:
    """A request's sampling seed: a function of where it is in the run, not of the batch."""
    return (run_seed * TRAINER_SEED_SPACE + stream * 7_919_993 + step * 10_007 + index) % (2 ** 31 - 1)


@dataclass
class Batch:
    """One step's samples as every trainer rank sees them (tensors are [B, T])."""

    records: List[PromptRecord]
    rows: List[SampleRow]
    rollouts: Rollouts
    rewards: Optional[torch.Tensor] = None  # [B]
    correct: Optional[List[Optional[bool]]] = None
    teacher_logprobs: Optional[torch.Tensor] = None
    aliases: Optional[List[str]] = None  # the routed teacher alias per sample
    student_logprobs: Optional[torch.Tensor] = None
    weight_versions: List[int] = field(default_factory=list)  # the engines' weight versions (trainer steps)


class RLProgram:
    def __init__(self, ctx):
        self.ctx, self.cfg, self.plan, self.ident, self.log = ctx, ctx.cfg, ctx.plan, ctx.ident, ctx.log
        offsets = role_offsets(self.plan)
        self.trainer_role = self.plan.roles[0].name

        def ranks(role: str) -> List[int]:
            first, n = offsets.get(role, (0, 0))
            return list(range(first, first + n))

        self.trainer_ranks = ranks(self.trainer_role)
        self.gen_ranks = ranks("generator")
        self.env_ranks = ranks("env")
        self.teacher_groups: List[str] = [r.name.split("/", 1)[1] for r in self.plan.roles if r.name.startswith("teacher/")]
        self.teacher_first = {g: ranks(f"teacher/{g}")[0] for g in self.teacher_groups}
        self.router = TeacherRouter.from_config(self.cfg) if self.cfg.teachers else None
        if self.router is not None and list(self.router.groups) != self.teacher_groups:
            raise RuntimeError(f"teacher groups of the plan {self.teacher_groups} differ from routing's {self.router.groups}")
        self.mopd = self.cfg.algo.name == "mopd"
        if not self.gen_ranks:
            raise RuntimeError("the RL loop needs a generator role")
        self.role = self.ident.role
        self.is_trainer = self.role == self.trainer_role
        self.is_driver = self.ident.global_rank == 0
        self.my_teacher = self.role.split("/", 1)[1] if self.role.startswith("teacher/") else None
        self.backend = None  # trainer: the trained student; teacher: inference-only
        self.engine = None
        self.refit_ep = None
        self.pad_id = 0
        self.timing: Dict[str, float] = {}  # this step's phases
        self.setup_timing: Dict[str, float] = {}

    # ----------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig

        cfg, ctx = self.cfg, self.ctx
        t0 = time.perf_counter()
        if self.is_trainer:
            o, s = cfg.trainer.optimizer, cfg.trainer.scheduler
            optim = OptimConfig(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                grad_clip=o.grad_clip, warmup_steps=s.warmup_steps, warmup_start_lr=s.warmup_start_lr)
            self.backend = FSDP2Backend(cfg.model.path, group=ctx.groups.role, precision=cfg.trainer.precision,
                                        optim=optim, train=True, device=ctx.device)
            self.log.info("student %s loaded (FSDP2 over %d ranks, %s)", cfg.model.path, len(self.trainer_ranks),
                          cfg.trainer.precision)
        elif self.my_teacher is not None:
            t = cfg.teachers[self.my_teacher]
            self.backend = FSDP2Backend(t.checkpoint, group=ctx.groups.role, precision=t.precision, train=False,
                                        device=ctx.device)
            self.log.info("teacher group %s (aliases %s) loaded from %s", self.my_teacher,
                          [a for a in cfg.teachers if self.router.group_of(a) == self.my_teacher], t.checkpoint)
        elif self.role == "generator":
            from hpc_rl.refit.vllm_engine import VLLMGenerator

            g = cfg.generator
            on_gpu = ctx.device.startswith("cuda")
            # On CPU vLLM reserves this share of NUMA node 0's memory for its KV cache; the
            # GPU default (0.85) cannot be met there, so CPU runs take at most 0.2.
            frac = g.gpu_memory_utilization if on_gpu else min(g.gpu_memory_utilization, 0.2)
            self.engine = VLLMGenerator(cfg.model.path, precision=g.precision,
                                        max_model_len=g.max_model_len or cfg.trainer.max_seq_len,
                                        seed=cfg.run.seed + self.ident.role_rank, memory_fraction=frac,
                                        max_num_seqs=g.max_num_seqs)
            self.log.info("vLLM engine up (%s, %s)", g.precision, ctx.device)
        self.pad_id = self._pad_id()
        self.setup_timing["load_s"] = time.perf_counter() - t0
        self._join_refit()
        dist.barrier(group=ctx.groups.world)
        self.setup_timing["setup_s"] = time.perf_counter() - t0
        self.log.info("setup done in %.1fs", self.setup_timing["setup_s"])

    def _pad_id(self) -> int:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.cfg.model.path)
        self.tokenizer = tok
        return tok.pad_token_id if tok.pad_token_id is not None else 0

    def _join_refit(self) -> None:
        """The refit group: every trainer rank (its FSDP2 shards) and each generator engine's
        worker. Trainer rank 0 describes both sides' layouts; every member rebuilds the same
        plan from that description. The engine checks the names and shapes against its live
        model first, so a mismatch stops the run here, before any step."""
        from hpc_rl.refit.vllm_engine import engine_first_rank, refit_setup
        from hpc_rl.refit.vllm_layout import check_against_model, specs_of

        cfg = self.cfg
        engine_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[cfg.generator.precision]
        setup = None
        if self.is_driver:
            specs = specs_of(self.backend.model.state_dict(), engine_dtype)
            setup = refit_setup(specs, len(self.trainer_ranks), len(self.gen_ranks), f"refit/{self.ident.restart}",
                                timeout_s=cfg.refit.timeout_s, bucket_bytes=cfg.refit.bucket_mb << 20,
                                transport=cfg.refit.transport, domain_of=self._refit_domains())
        setup = share(setup, src=0, group=self.ctx.groups.world)
        self.refit_dtype = getattr(torch, engine_dtype)
        if self.is_trainer:
            from hpc_rl.refit.session import RefitEndpoint
            from hpc_rl.refit.transport import make_transport

            transport = make_transport(setup.transport, self.ctx.store, setup.prefix, self.ident.role_rank, setup.world,
                                       setup.names, setup.timeout_s, cuda=self.ctx.device.startswith("cuda"))
            self.refit_ep = RefitEndpoint(setup, self.ident.role_rank, transport, sources=self._refit_sources())
            if self.is_driver:
                stats = self.refit_ep.plan.stats
                self.log.info("refit plan: %d transfers in %d buckets, %.1f MB (%s)", stats["transfers"],
                              stats["buckets"], stats["bytes"] / 1e6, "domains from the placement" if setup.domain_of
                              else "no domain map: every rank its own")
        elif self.engine is not None:
            from hpc_rl.refit.layout import Layout

            check_against_model({n: (t.shape, t.dtype) for n, t in Layout.from_dict(setup.dst).tensors.items()},
                                self.engine.params())
            self.engine.join_refit(setup, engine_first_rank(len(self.trainer_ranks), self.ident.role_rank), self.ctx.store_addr,
                                   self.ctx.store_port)

    def _refit_domains(self) -> Optional[Dict[int, str]]:
        """Refit layout rank -> NVLink domain, from the placement made at rendezvous (trainer
        ranks first, then one rank per engine); None when the placement has no domains."""
        placement = getattr(self.ctx, "placement", None)
        if placement is None or not getattr(placement, "roles", None):
            return None
        ranks = [(self.trainer_role, i) for i in range(len(self.trainer_ranks))] + \
                [("generator", g) for g in range(len(self.gen_ranks))]
        out: Dict[int, str] = {}
        for layout_rank, (role, role_rank) in enumerate(ranks):
            rp = placement.roles.get(role)
            if rp is None:
                return None
            segment = (role_rank // self.plan.role(role).tasks_per_node) // rp.segment_size
            if segment >= len(rp.segment_domains):
                return None
            out[layout_rank] = rp.segment_domains[segment]
        return out

    def _refit_sources(self):
        """This trainer rank's shards in the engine's dtype, under its refit rank: the live
        parameters when the dtypes agree, else cast copies kept between refits (so the
        prepared walk stays valid)."""
        live = self.backend.local_shards()
        if all(t.dtype == self.refit_dtype for _, t in live.values()):
            return {self.ident.role_rank: live}
        if getattr(self, "_refit_cast", None) is None:
            self._refit_cast = {n: (start, t.to(self.refit_dtype)) for n, (start, t) in live.items()}
        else:
            for n, (_, t) in live.items():
                self._refit_cast[n][1].copy_(t)
        return {self.ident.role_rank: self._refit_cast}

    # ------------------------------------------------------------------------------ collection
    def collect(self, records: Optional[List[PromptRecord]], sampling: Dict[str, Any], stream: int, step: int,
                with_teachers: bool, with_env: bool) -> Optional[Batch]:
        """Generate for `records` (given on the driver) and score; every rank calls it.
        Returns the Batch on trainer ranks, None elsewhere."""
        world = self.ctx.groups.world
        t0 = time.perf_counter()
        records = share(records, src=0, group=world)
        n = len(records)

        # 2. generate: round robin over generator ranks
        piece: List[SampleRow] = []
        if self.engine is not None:
            mine = strided(n, self.ident.role_rank, len(self.gen_ranks))
            prompts = self._chat_messages([records[i] for i in mine])
            piece = self.engine.sample(prompts, seed=[_seed(self.cfg.run.seed, stream, step, i) for i in mine], **sampling)
        # each engine's share travels with the weight version it sampled with
        mine_out = (self.engine.weight_version, piece) if self.engine is not None else None
        shared = [share(mine_out if self.ident.global_rank == src else None, src=src, group=world) for src in self.gen_ranks]
        versions = sorted({v for v, _ in shared})
        rows: List[SampleRow] = interleave([p for _, p in shared], n)
        t_gen = time.perf_counter()

        # 3. score: every scoring rank computes first, then the results are shared in a fixed order
        env_piece = self._env_score(records, rows) if (with_env and self.role == "env") else None
        teacher_piece = self._teacher_score(records, rows) if (with_teachers and self.my_teacher) else None
        student = self._student_logprobs(rows) if self.is_trainer else None
        rewards = correct = None
        if with_env and self.env_ranks:
            env_pieces = [share(env_piece if self.ident.global_rank == src else None, src=src, group=world)
                          for src in self.env_ranks]
            scored = interleave(env_pieces, n)
            rewards = torch.tensor([s[0] for s in scored], dtype=torch.float32)
            correct = [s[1] for s in scored]
        teacher_rows: Dict[int, List[float]] = {}
        if with_teachers and self.teacher_groups:
            for g in self.teacher_groups:
                teacher_rows.update(share(teacher_piece if self.ident.global_rank == self.teacher_first[g] else None,
                                          src=self.teacher_first[g], group=world))
        t_score = time.perf_counter()
        if not self.is_trainer:
            return None
        batch = Batch(records, rows, pad_rows(rows, self.pad_id), rewards, correct, student_logprobs=student,
                      weight_versions=versions)
        if teacher_rows:
            tlp = torch.zeros_like(batch.rollouts.generation_logprobs)
            for i, lps in teacher_rows.items():
                p = len(rows[i].prompt_ids)
                tlp[i, p:p + len(lps)] = torch.tensor(lps, dtype=torch.float32)
            batch.teacher_logprobs = tlp
            batch.aliases = [self.router.route(r.agent) for r in records]
        self.timing.update(generate_s=t_gen - t0, score_s=t_score - t_gen)
        return batch

    def _chat_messages(self, recs: Sequence[PromptRecord]) -> List[str]:
        tok = self.engine.tokenizer
        out = []
        for r in recs:
            msgs = [{"role": "user", "content": r.prompt}] if isinstance(r.prompt, str) else list(r.prompt)
            out.append(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
        return out

    def _env_score(self, records: List[PromptRecord], rows: List[SampleRow]) -> List[Tuple[float, Optional[bool]]]:
        from hpc_rl.envs.registry import score

        out = []
        for i in strided(len(rows), self.ident.role_rank, len(self.env_ranks)):
            rec = records[i]
            if rec.task is None or rec.answer is None:
                out.append((0.0, None))  # no verifier for this row: no reward, not counted in accuracy
                continue
            res = score(rec.task, rows[i].text, rec.answer)
            out.append((float(res.reward), bool(res.correct)))
        return out

    def _teacher_score(self, records: List[PromptRecord], rows: List[SampleRow]) -> Dict[int, List[float]]:
        """Logprobs of the sampled tokens under this group's teacher, for the samples routed here.
        Every rank of the group computes (FSDP needs them all); its first rank shares."""
        mine = [i for i, r in enumerate(records) if self.router.group_of(self.router.route(r.agent)) == self.my_teacher]
        if not mine:
            return {}
        sub = pad_rows([rows[i] for i in mine], self.pad_id)
        lp = self.backend.logprobs(sub.input_ids, sub.attention_mask).float().cpu()
        out = {}
        for j, i in enumerate(mine):
            p, g = sub.prompt_lengths[j], sub.generation_lengths[j]
            out[i] = lp[j, p:p + g].tolist()
        return out

    def _student_logprobs(self, rows: List[SampleRow]) -> torch.Tensor:
        """[B, T] student logprobs of the whole batch: each trainer rank computes its strided
        share (FSDP all-gathers the weights per layer), then they exchange shares."""
        full = pad_rows(rows, self.pad_id)
        n_tr = len(self.trainer_ranks)
        mine = strided(len(rows), self.ident.role_rank, n_tr)
        lp = self.backend.logprobs(full.input_ids[mine], full.attention_mask[mine]).float().cpu()
        if n_tr == 1:
            return lp
        shares = gather_all(lp, self.ctx.groups.role)
        out = torch.zeros(full.input_ids.shape, dtype=torch.float32)
        for k, t in enumerate(shares):
            out[strided(len(rows), k, n_tr)] = t
        return out

    # ---------------------------------------------------------------------------------- train
    def advantages(self, b: Batch) -> torch.Tensor:
        mask = b.rollouts.response_mask
        if self.mopd:
            o = self.cfg.algo.opd
            return opd_advantages(b.teacher_logprobs, b.student_logprobs, mask, o.adv_clip, o.baseline)
        g = self.cfg.algo.grpo
        adv = grpo_advantages(b.rewards, self.cfg.algo.generations_per_prompt, g.leave_one_out, g.normalize_std)
        return per_token(adv, mask)

    def train(self, b: Batch) -> Dict[str, Any]:
        a = self.cfg.algo
        r = b.rollouts
        mask = r.response_mask
        adv = self.advantages(b)
        mm = a.mismatch
        weights = importance_weights(b.student_logprobs, r.generation_logprobs, mask, mm.kind, mm.min, mm.max)
        keep_seq = sequence_keep_mask(b.student_logprobs, r.generation_logprobs, mask, mm.seq_logprob_error_threshold)
        train_mask = mask & keep_seq[:, None]
        n = len(b.rows)
        gbs = self.cfg.trainer.global_batch_size
        n_tr = len(self.trainer_ranks)
        metrics: List[Dict[str, float]] = []
        for start in range(0, n, gbs):
            idx = list(range(start, min(start + gbs, n)))[self.ident.role_rank::n_tr]

            def loss_fn(lp, idx=idx):
                return policy_loss(lp, b.student_logprobs[idx], adv[idx], train_mask[idx], kind=a.loss.kind,
                                   clip_low=a.loss.ratio_clip_low, clip_high=a.loss.ratio_clip_high, weights=weights[idx])

            metrics.append(self.backend.train_step(r.input_ids[idx], r.attention_mask[idx], loss_fn))
        out = {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}
        if n_tr > 1:  # average the ranks' minibatch metrics
            keys = sorted(out)
            v = torch.tensor([out[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(v, group=self.ctx.groups.role)
            out = {k: float(x) / n_tr for k, x in zip(keys, v)}
        out["advantage_mean"] = float(masked_mean(adv, mask))
        out["seqs_masked_by_mismatch"] = int((~keep_seq).sum())
        out["optimizer_steps"] = len(metrics)
        return out

    def refit(self, version: int) -> float:
        """Trainer shards -> generator engines, slice by slice along the refit plan; the
        engines stamp `version`. Raises RefitError naming a peer that died or is late."""
        t0 = time.perf_counter()
        if self.is_trainer:
            self.refit_ep.set_sources(self._refit_sources())
            self.refit_ep.run(self.cfg.refit.timeout_s)
        elif self.engine is not None:
            out = self.engine.refit(version, self.cfg.refit.timeout_s)
            self.log.debug("refit to version %d: %s", version, out)
        return time.perf_counter() - t0

    # ----------------------------------------------------------------------------------- loop
    def run(self) -> Dict[str, Any]:
        cfg = self.cfg
        self.setup()
        dataset = load_dataset(cfg, self.ctx.run_dir)
        it = PromptIterator(dataset, cfg.algo.prompts_per_step, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        start = self._resume(it)
        metrics_log, store = MetricsLog(self.ctx.run_dir), RolloutStore(self.ctx.run_dir)
        progress = Progress(self.ctx.run_dir, cfg.run.max_steps, first_step=start) if self.is_driver else None
        if self.is_driver and dataset.skipped:
            self.log.warning("%d malformed dataset rows skipped (data.skip_invalid): lines %s", dataset.skipped,
                             dataset.skipped_lines[:20])
        sampling = self._sampling()
        evals = eval_records(dataset, cfg.data.eval_prompts_per_task, cfg.run.seed) if cfg.data.eval_prompts_per_task else []
        if evals and start == 1:
            self._evaluate("start", evals, 0, progress, metrics_log)
        last: Dict[str, Any] = {}
        self._last_saved = start - 1
        for step in range(start, cfg.run.max_steps + 1):
            # Between steps: has the batch shell asked for a save (USR1: the time limit is near)?
            stop = share(self._save_requested() if self.is_driver else None, src=0, group=self.ctx.groups.world)
            if stop:
                return self._stop_for_requeue(step - 1, it, stop)
            maybe_inject(cfg.ft.inject_failure, self.role, self.ident.role_rank, self.ident.restart, step)
            t0 = time.perf_counter()
            self._phase(progress, step, "generate")
            records = None
            if self.is_driver:
                records = [r for r in next(it) for _ in range(cfg.algo.generations_per_prompt)]
            batch = self.collect(records, sampling, stream=1, step=step, with_teachers=self.mopd, with_env=True)
            self._phase(progress, step, "train")
            train_metrics = self.train(batch) if self.is_trainer else {}
            t_train = time.perf_counter()
            self._phase(progress, step, "refit")
            refit_s = self.refit(step)
            if step % cfg.checkpoint.every_steps == 0 or step == cfg.run.max_steps:
                self._phase(progress, step, "checkpoint")
                self._checkpoint(step, it)
            if self.is_driver:
                timing = dict(self.timing, train_s=t_train - t0 - self.timing["generate_s"] - self.timing["score_s"],
                              refit_s=refit_s, step_s=time.perf_counter() - t0)
                last = self._record(step, batch, train_metrics, timing, metrics_log, store)
                self.log.info("step %d/%d: %s", step, cfg.run.max_steps, _brief(last))
        if evals:
            self._evaluate("end", evals, cfg.run.max_steps, progress, metrics_log)
        # one gather of the trained weights (a collective of the trainer ranks) serves both
        final = self.backend.full_state_dict() if self.is_trainer else None
        digest = _weights_digest(final) if self.is_driver else None
        if cfg.checkpoint.export_final and self.is_trainer:
            from hpc_rl.ckpt import export_hf

            out = export_hf(self.backend, self.ctx.run_dir / "final_hf", tokenizer_dir=cfg.model.path,
                            group=self.ctx.groups.role, overwrite=True, state=final)
            if self.is_driver:
                self.log.info("trained weights exported to %s (Hugging Face safetensors)", out)
        summary = None
        if self.is_driver:
            summary = summarize(self.ctx.run_dir, {"algo": cfg.algo.name, "recipe": cfg.recipe,
                                                   "final_weights_sha256": digest, "restarts": self.ident.restart})
            progress.update(cfg.run.max_steps + 1, "done", done_steps=cfg.run.max_steps)
        self.ctx.finish()  # before the final barrier: no peer sees this rank go quiet first
        dist.barrier(group=self.ctx.groups.world)
        return {"role": self.role, "rank": self.ident.role_rank, "steps": cfg.run.max_steps - start + 1,
                "summary": summary}

    def _phase(self, progress, step: int, phase: str) -> None:
        self.ctx.set_phase(f"step {step} {phase}")
        if progress:
            progress.update(step, phase)

    # --------------------------------------------------------------------- preemption, deadlines
    def _save_requested(self) -> Optional[str]:
        """The batch shell touches this file when Slurm sends USR1 (time limit near)."""
        req = self.ctx.run_dir / SAVE_REQUEST.format(restart=self.ident.restart)
        return req.read_text().strip() or "save requested" if req.exists() else None

    def _stop_for_requeue(self, done_step: int, it: PromptIterator, why: str) -> Dict[str, Any]:
        t0 = time.time()
        if done_step > self._last_saved:
            self._checkpoint(done_step, it)
        if self.is_driver:
            now = time.time()
            self.log.warning("stopping after step %d for a requeue (%s); checkpoint on disk %.2fs after the request",
                             done_step, why, now - t0)
            (self.ctx.run_dir / STOPPED.format(restart=self.ident.restart)).write_text(
                json.dumps({"step": done_step, "saved": self._last_saved == done_step, "time": now,
                            "save_s": now - t0}) + "\n")
        self.ctx.finish()
        dist.barrier(group=self.ctx.groups.world)
        return {"role": self.role, "rank": self.ident.role_rank, "stopped_after": done_step}

    def _save_fits(self) -> bool:
        return save_fits(os.environ.get("HPC_RL_JOB_END"), time.time(), self.cfg.ft.save_margin_s,
                         getattr(self, "_last_save_s", None))

    def _sampling(self) -> Dict[str, Any]:
        s = self.cfg.generator.sampling
        return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "max_tokens": s.max_tokens,
                "stop": list(s.stop)}

    # ------------------------------------------------------------------------------ eval
    def _evaluate(self, tag: str, evals: List[PromptRecord], step: int, progress, metrics_log) -> None:
        """Fixed prompts at the start and the end: greedy accuracy per task and, with teachers,
        the reverse KL of sampled answers to their routed teacher."""
        if progress:
            progress.update(max(step, 1), f"eval {tag}")
        greedy = dict(self._sampling(), temperature=0.0, top_p=1.0, top_k=-1)
        g = self.collect(evals if self.is_driver else None, greedy, stream=2, step=step, with_teachers=False, with_env=True)
        kl: Dict[str, float] = {}
        if self.mopd and self.teacher_groups:
            s = self.collect(evals if self.is_driver else None, self._sampling(), stream=3, step=step,
                             with_teachers=True, with_env=False)
            if self.is_trainer:
                kl = self._kl(s)
        teacher_acc = self._teacher_accuracy(evals) if tag == "start" and self.mopd and self.teacher_groups else {}
        if not self.is_driver:
            return
        acc = _accuracy_by_task(g.records, g.correct)
        rec = {"kind": "eval", "tag": tag, "step": step, "accuracy": acc, "reverse_kl": kl, "time": time.time(),
               "teacher_accuracy": teacher_acc, "prompts": len(evals)}
        metrics_log.append(rec)
        self.log.info("eval %s: accuracy %s; reverse KL %s", tag, _fmt(acc), _fmt(kl))

    def _teacher_accuracy(self, evals: List[PromptRecord]) -> Dict[str, float]:
        """Each teacher group's greedy accuracy on the eval prompts routed to it (what the
        student is distilled toward)."""
        from hpc_rl.envs.registry import score
        from hpc_rl.models.assets import chat_prompt

        piece: Dict[str, List[bool]] = {}
        if self.my_teacher is not None:
            mine = [r for r in evals if r.task is not None and isinstance(r.prompt, str)
                    and self.router.group_of(self.router.route(r.agent)) == self.my_teacher]
            if mine:
                # one left-padded batch: generation appends on the right
                prompts = [chat_prompt(self.tokenizer, r.prompt) for r in mine]
                width = max(map(len, prompts))
                ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
                attn = torch.zeros_like(ids)
                for i, p in enumerate(prompts):
                    ids[i, width - len(p):] = torch.tensor(p)
                    attn[i, width - len(p):] = 1
                with torch.no_grad():
                    out = self.backend.model.generate(ids.to(self.backend.device), attention_mask=attn.to(self.backend.device),
                                                      do_sample=False, max_new_tokens=self.cfg.generator.sampling.max_tokens,
                                                      eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.pad_id)
                for r, row in zip(mine, out[:, width:].cpu()):
                    text = self.tokenizer.decode(row, skip_special_tokens=True)
                    piece.setdefault(_task_key(r), []).append(bool(score(r.task, text, r.answer).correct))
        merged: Dict[str, List[bool]] = {}
        for g in self.teacher_groups:
            for k, v in share(piece if self.ident.global_rank == self.teacher_first[g] else None,
                              src=self.teacher_first[g], group=self.ctx.groups.world).items():
                merged.setdefault(k, []).extend(v)
        return {k: sum(v) / len(v) for k, v in merged.items()}

    def _kl(self, b: Batch) -> Dict[str, float]:
        names = sorted(set(b.aliases))
        index = torch.tensor([names.index(a) for a in b.aliases])
        return reverse_kl_per_teacher(b.student_logprobs, b.teacher_logprobs, b.rollouts.response_mask, index, names)

    # ------------------------------------------------------------------------------ records
    def _record(self, step: int, b: Batch, train: Dict[str, Any], timing: Dict[str, float],
                metrics_log: MetricsLog, store: RolloutStore) -> Dict[str, Any]:
        r = b.rollouts
        mask = r.response_mask
        rec: Dict[str, Any] = {"kind": "step", "step": step, "time": time.time(), "samples": len(b.rows),
                               "response_len_mean": float(np.mean(r.generation_lengths)),
                               "truncated_frac": float(np.mean(r.truncated)),
                               "token_mult_prob_error": token_mult_prob_error(r.generation_logprobs, b.student_logprobs, mask),
                               "weight_version": min(b.weight_versions), **train, "timing": timing}
        if b.rewards is not None:
            rec["reward_mean"] = float(b.rewards.mean())
            rec["accuracy"] = _accuracy_by_task(b.records, b.correct)
        if b.teacher_logprobs is not None:
            rec["reverse_kl"] = self._kl(b)
        metrics_log.append(rec)
        adv = self.advantages(b)
        arrays = {"input_ids": r.input_ids.numpy().astype(np.int32), "attention_mask": r.attention_mask.numpy().astype(np.int8),
                  "response_mask": mask.numpy().astype(np.int8), "generation_logprobs": r.generation_logprobs.numpy(),
                  "student_logprobs": b.student_logprobs.numpy(), "advantages": adv.numpy(),
                  "truncated": np.array(r.truncated, dtype=np.int8)}
        if b.teacher_logprobs is not None:
            arrays["teacher_logprobs"] = b.teacher_logprobs.numpy()
        if b.rewards is not None:
            arrays["rewards"] = b.rewards.numpy()
        strings = {"agents": [x.agent for x in b.records], "texts": r.texts,
                   "tasks": [x.task or "" for x in b.records]}
        if b.aliases:
            strings["teachers"] = b.aliases
        store.write(step, arrays, strings, attrs={"weight_version": min(b.weight_versions)})
        return rec

    # ------------------------------------------------------------------------------ checkpoints
    def _ckpt_root(self) -> Path:
        return Path(self.cfg.checkpoint.dir) if self.cfg.checkpoint.dir else self.ctx.run_dir / "checkpoints"

    def _checkpoint(self, step: int, it: PromptIterator) -> None:
        """Every rank calls it (the go/no-go decision is shared); trainer ranks save."""
        from hpc_rl.ckpt import apply_retention, capture_rng_state, save_checkpoint

        go = share(self._save_fits() if self.is_driver else None, src=0, group=self.ctx.groups.world)
        if not go:
            if self.is_driver:
                self.log.warning("step %d: checkpoint skipped, it would not finish %.0fs before the job's end "
                                 "(last save took %.1fs)", step, self.cfg.ft.save_margin_s, getattr(self, "_last_save_s", 0.0))
            return
        if self.is_trainer:
            t0 = time.time()
            extra = {"step": step, "iterator": it.state_dict(), "rng": capture_rng_state()}
            config_yaml = (self.ctx.run_dir / "config.yaml").read_text()
            spec, ident = self.cfg.ft.inject_failure, self.ident
            save_checkpoint(self._ckpt_root(), step, self.backend, extra, config_yaml, group=self.ctx.groups.role,
                            recipe=self.cfg.recipe,
                            before_publish=lambda: maybe_inject(spec, ident.role, ident.role_rank, ident.restart, f"save{step}"))
            self._last_save_s = time.time() - t0
            if self.is_driver:
                apply_retention(self._ckpt_root(), self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every)
        self._last_saved = step

    def _resume(self, it: PromptIterator) -> int:
        """The first step to run: 1, or one past the newest complete checkpoint (trainer ranks
        load it; generators then receive its weights)."""
        from hpc_rl.ckpt import find_resumable, load_checkpoint, model_fingerprint, restore_rng_state

        found = None
        if not self.cfg.checkpoint.resume:
            if self.is_driver:
                MetricsLog(self.ctx.run_dir).truncate_after(0)
                RolloutStore(self.ctx.run_dir).truncate_after(0)
                self.log.warning("checkpoint.resume=false: starting fresh; checkpoints under %s are ignored",
                                 self._ckpt_root())
            return 1
        if self.is_driver:
            scan = find_resumable(self._ckpt_root(), model_fingerprint(self.backend.model), self.cfg.recipe)
            for path, why in scan.skipped:
                self.log.warning("skipped checkpoint %s: %s", path, why)
            found = (str(scan.path), scan.step) if scan else None
        found = share(found, src=0, group=self.ctx.groups.world)
        if found is None:
            return 1
        path, step = found
        if self.is_trainer:
            extra = load_checkpoint(path, self.backend, group=self.ctx.groups.role)
            it.load_state_dict(extra["iterator"])
            restore_rng_state(extra["rng"])
        if self.is_driver:
            recomputed = MetricsLog(self.ctx.run_dir).truncate_after(step)
            RolloutStore(self.ctx.run_dir).truncate_after(step)
            self.log.info("restart %d resumed from %s (step %d); %d completed steps after it will be recomputed",
                          self.ident.restart, path, step, recomputed)
            with (self.ctx.run_dir / RESTARTS).open("a") as f:
                f.write(json.dumps({"restart": self.ident.restart, "resumed_from_step": step, "checkpoint": path,
                                    "steps_recomputed": recomputed, "time": time.time()}) + "\n")
        self.refit(step)  # the generators still hold the initial weights
        return step + 1


def save_fits(job_end: Optional[str], now: float, margin_s: float, last_save_s: Optional[float],
              first_guess_s: float = 10.0) -> bool:
    """Whether a checkpoint save started `now` ends `margin_s` before the job's end (epoch
    seconds from the batch shell; unknown: always). The estimate is 1.5x the last save, or
    `first_guess_s` before the first: a save cut by the time limit is worse than none."""
    if not job_end:
        return True
    estimate = 1.5 * (last_save_s if last_save_s is not None else first_guess_s)
    return float(job_end) - now - margin_s > estimate


def _task_key(r: PromptRecord) -> str:
    return r.agent


def _accuracy_by_task(records: Sequence[PromptRecord], correct: Optional[Sequence[Optional[bool]]]) -> Dict[str, float]:
    by: Dict[str, List[bool]] = {}
    for r, c in zip(records, correct or []):
        if c is not None:
            by.setdefault(_task_key(r), []).append(c)
    return {k: sum(v) / len(v) for k, v in sorted(by.items())}


def _fmt(d: Dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in d.items()) or "-"


def _brief(rec: Dict[str, Any]) -> str:
    parts = []
    if "reverse_kl" in rec:
        parts.append(f"KL {rec['reverse_kl'].get('mean', float('nan')):.3f}")
    if "reward_mean" in rec:
        parts.append(f"reward {rec['reward_mean']:.3f}")
    parts.append(f"mult_prob_err {rec['token_mult_prob_error']:.4f}")
    parts.append(f"loss {rec.get('loss', float('nan')):.4f}")
    parts.append(f"{rec['timing']['step_s']:.2f}s")
    return ", ".join(parts)


def run(ctx) -> Dict[str, Any]:
    return RLProgram(ctx).run()


def _weights_digest(state: Dict[str, torch.Tensor]) -> str:
    """sha256 of the trained weights (each name and its bytes, in name order): resumed runs compare equal bit for bit."""
    import hashlib

    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()

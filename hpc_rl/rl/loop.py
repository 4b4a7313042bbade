"""`run.program=rl`: the RL / MOPD loop, read top to bottom.

The trainer ranks run the orchestration; trainer rank 0 (the driver) speaks for them.
Every other role serves what its producers send (hpc_rl/roles/): generators sample when
ordered and forward rows to the ranks that score them; env ranks and teacher groups
answer the driver. One step:

  1. prompts   the driver draws the batch (each prompt repeated generations_per_prompt
               times, consecutively) and orders each generator to sample its share
  2. collect   rows go to env ranks (rewards), teacher groups (log-probs of the sampled
               tokens, each sample by exactly the teacher it is routed to) and the driver;
               the trainer ranks recompute the student's log-probs meanwhile
  3. train     advantages (MOPD: teacher - student per token; GRPO: group-normalised
               rewards), mismatch weights, one optimizer step per minibatch
  4. refit     trainer shards -> every engine, along the refit plan
  5. ckpt      every checkpoint.every_steps; the run resumes from the newest complete one
The driver records metrics, rollouts and progress.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Dict

import torch
import torch.distributed as dist

from hpc_rl.agentic.faults import check_error_share
from hpc_rl.algo.routing import TeacherRouter
from hpc_rl.data.dataset import PromptIterator
from hpc_rl.engines.base import Sampling
from hpc_rl.ft.preemption import save_requested, write_stopped
from hpc_rl.observe.loggers import open_sink
from hpc_rl.roles.trainer import TrainerRole
from hpc_rl.rundir import RunDir
from hpc_rl.runtime import auth_stats
from hpc_rl.runtime.faults import maybe_inject

from hpc_rl.messaging import p2p as exchange
from hpc_rl.messaging.messages import END, REFIT, STOP
from .async_rollout import AsyncRollouts
from .checkpointing import Checkpointer
from .collect import Collector
from .dynamic_sampling import step_batch
from .eval import evaluate
from .inputs import eval_records, load_dataset, load_validation
from .records import MetricsLog, Progress, RolloutStore, summarize, update_summary
from .roles_setup import announce_end, domains_for_refit, pad_id_of, serve_role
from hpc_rl.messaging.routes import Routes
from .step_record import brief, record_step

TRAIN_STREAM = 1  # the training collections' seed stream (evaluations use others)


class RLLoop:
    def __init__(self, ctx, routes: Routes):
        self.ctx, self.cfg, self.routes, self.log = ctx, ctx.cfg, routes, ctx.log
        self.driver = ctx.ident.global_rank == routes.driver
        self.distill = self.cfg.algo.name == "mopd" and bool(routes.teachers)
        s = self.cfg.generator.sampling
        self.sampling = Sampling(s.temperature, s.top_p, s.top_k, s.max_tokens, tuple(s.stop), s.min_tokens)

    def setup(self) -> None:
        t0 = time.perf_counter()
        router = TeacherRouter.from_config(self.cfg) if self.routes.teachers else None
        self.trainer = TrainerRole(self.ctx, self.routes, pad_id_of(self.cfg.model.path))
        self.trainer.join_refit(domains_for_refit(self.ctx, self.routes))
        self.collector = Collector(self.ctx, self.routes, self.trainer, router, self.trainer.pad_id)
        self.ckpt = Checkpointer(self.ctx, self.trainer)
        self.pipeline = None  # AsyncRollouts with algo.async_rollout.enabled (rl/async_rollout.py)
        dist.barrier(group=self.ctx.groups.world)  # every role has loaded its model
        self.log.info("setup done in %.1fs", time.perf_counter() - t0)

    def run(self) -> Dict[str, Any]:
        cfg, run_dir = self.cfg, self.ctx.run_dir
        self.setup()
        dataset = load_dataset(cfg, run_dir)
        it = PromptIterator(dataset, cfg.algo.prompts_per_step, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        done = self.ckpt.resume(it)
        if done:
            self.refit(done)  # the engines still hold the initial weights
        if cfg.algo.async_rollout.enabled:
            self.pipeline = AsyncRollouts(self.ctx, self.collector, self.trainer, self.sampling, it, TRAIN_STREAM,
                                          self.distill)
            self.pipeline.load_state_dict(self.ckpt.resumed_extra.get("rollout_buffer"))
        store = RolloutStore(run_dir)
        # trainer rank 0 alone writes metrics: metrics.jsonl and the loggers of cfg.logger (observe/)
        metrics = open_sink(cfg, run_dir, MetricsLog(run_dir), done, self.log) if self.driver else None
        progress = Progress(run_dir, cfg.run.max_steps, first_step=done + 1) if self.driver else None
        if self.driver and dataset.skipped:
            self.log.warning("%d malformed dataset rows skipped (data.skip_invalid): lines %s", dataset.skipped,
                             dataset.skipped_lines[:20])
        evals = self.validation_prompts(run_dir)  # held out: never drawn by `it` (rl/heldout.py)
        if evals and done == 0:
            self.evaluate("start", evals, 0, progress, metrics)

        for step in range(done + 1, cfg.run.max_steps + 1):
            # between steps: has the batch shell asked for a save (USR1: the time limit is near)?
            self.phase(progress, step, "start")  # an injected stall is this rank's own time in this step
            why = save_requested(run_dir, self.ctx.ident.restart) if self.driver else None
            exchange.mark_step(step)
            ident = self.ctx.ident
            maybe_inject(cfg.ft.inject_failure, ident.role, ident.role_rank, ident.restart, step)
            t0 = time.perf_counter()
            self.phase(progress, step, "wait_rows")
            # async rollouts' buffer, dynamic sampling's collections, or one collection (rl/dynamic_sampling.py)
            batch = step_batch(self.pipeline, self.collector, it, self.sampling, TRAIN_STREAM, step, why, self.distill)
            if isinstance(batch, str):  # the driver's reason, shared with the rows' header
                if metrics:
                    metrics.close()
                return self.stop_for_requeue(step - 1, it, batch)
            if batch.info.get("agentic"):  # too many failed episodes: end the run, do not train on them
                a = cfg.env.agentic
                check_error_share(batch.info["agentic"], a.max_error_share, a.environment, step)
            if not self.pipeline:  # lock-step: every sample comes from this step's policy
                check_age_bound(batch, step, cfg.algo.async_rollout.max_trajectory_age_steps)
            self.phase(progress, step, "train")
            maybe_inject(cfg.ft.inject_failure, ident.role, ident.role_rank, ident.restart, f"train{step}")
            t_train = time.perf_counter()
            train = self.trainer.train(batch)
            train_s = time.perf_counter() - t_train
            if self.pipeline:
                # sent after the gather, before this train step; in flight: sent now, while the next step samples
                refit_s = batch.timing.pop("refit_s") + self.pipeline.after_train(step)
            else:
                self.phase(progress, step, "refit")
                refit_s = self.trainer.refit()  # the engines expect it after a training collection
            ckpt_s = 0.0
            if self.ckpt.due(step):
                self.phase(progress, step, "checkpoint")
                t_ckpt = time.perf_counter()
                self.save(step, it)
                ckpt_s = time.perf_counter() - t_ckpt
            if self.driver:
                self.phase(progress, step, "record")
                timing = dict(batch.timing, train_s=train_s, refit_s=refit_s, checkpoint_s=ckpt_s,
                              step_s=time.perf_counter() - t0)
                rec = record_step(step, batch, train, timing, metrics, store)
                self.log.info("step %d/%d: %s", step, cfg.run.max_steps, brief(rec))
            self.validate_between(step, evals, progress, metrics)  # data.validation.every_steps

        if evals:
            if self.pipeline:  # the engines hold the weights of the step before the last
                self.refit(cfg.run.max_steps)
            self.evaluate("end", evals, cfg.run.max_steps, progress, metrics)
        result = self.finish(progress, steps=cfg.run.max_steps - done)
        if metrics:
            metrics.close(finished=True)  # also draws the plots, the last thing a finished run writes
        return result

    # ----------------------------------------------------------------------------- pieces
    def refit(self, version: int) -> float:
        """Outside a step (a resume): the driver orders the engines to receive `version`;
        every trainer rank sends."""
        self.ctx.set_phase("refit", None)
        if self.driver:
            self.collector.order(REFIT, version, [])
        return self.trainer.refit()

    def save(self, step: int, it: PromptIterator) -> None:
        """A checkpoint of every trainer rank; with async rollouts the generators' outstanding
        work is gathered first and the buffer is saved with it."""
        more = None
        if self.pipeline:
            self.pipeline.drain()
            more = {"rollout_buffer": self.pipeline.state_dict()}
        self.ckpt.save(step, it, more)

    def validation_prompts(self, run_dir) -> list:
        """The fixed validation prompts of every validation of this run (empty: off)."""
        d = self.cfg.data
        if not d.eval_prompts_per_task:
            return []
        validation = load_validation(self.cfg, run_dir)
        evals = eval_records(validation, d.eval_prompts_per_task, self.cfg.run.seed)
        if self.driver:
            agents = sorted({r.agent for r in evals})
            short = {a: n for a in agents if (n := sum(r.agent == a for r in evals)) < d.eval_prompts_per_task}
            self.log.info("validation: %d held-out prompts (%s)%s", len(evals), d.validation.path or
                          f"{d.validation.split:.0%} of the training items", f"; fewer than data.eval_prompts_per_task="
                          f"{d.eval_prompts_per_task} for {short} (all the set has)" if short else "")
        return evals

    def validate_between(self, step: int, evals, progress, metrics) -> None:
        """A validation after this step's record, every data.validation.every_steps (the last
        step's is the end validation). Refused with async rollouts (config/validate_data.py):
        the engines' weights and the pipeline's outstanding order belong to other steps."""
        every = self.cfg.data.validation.every_steps
        if evals and every and step % every == 0 and step < self.cfg.run.max_steps and not self.pipeline:
            self.evaluate("step", evals, step, progress, metrics)

    def evaluate(self, tag: str, evals, step: int, progress, metrics: MetricsLog) -> None:
        self.ctx.set_phase("eval", None)  # not a training step's time
        if progress:
            progress.update(max(step, 1), f"eval {tag}")
        v = self.cfg.data.validation
        rec = evaluate(self.collector, tag, evals, step, self.sampling, self.distill, v.k, v.temperature)
        if rec is not None:
            metrics.append(rec)
        self.ckpt.record_validation(step, rec)  # keep-best reads it beside the step's checkpoint

    def phase(self, progress, step: int, phase: str) -> None:
        self.ctx.set_phase(phase, step)
        if progress:
            progress.update(step, phase)

    def stop_for_requeue(self, done_step: int, it: PromptIterator, why: str) -> Dict[str, Any]:
        t0 = time.time()
        self.ctx.set_phase("stop", None)  # the step it was in is abandoned: a resume recomputes it
        if self.driver:
            self.collector.order(STOP, done_step, [])
        if done_step > self.ckpt.last_saved:
            self.save(done_step, it)
        if self.driver:
            save_s = write_stopped(self.ctx.run_dir, self.ctx.ident.restart, done_step,
                                   self.ckpt.last_saved == done_step, t0)
            self.log.warning("stopping after step %d for a requeue (%s); checkpoint on disk %.2fs after the request",
                             done_step, why, save_s)
        return {"role": self.ctx.ident.role, "rank": self.ctx.ident.role_rank, "stopped_after": done_step}

    def finish(self, progress, steps: int) -> Dict[str, Any]:
        """The trained weights: one gather serves both the digest and the HF export."""
        cfg = self.cfg
        self.ctx.set_phase("finish", None)
        final = self.trainer.backend.full_state_dict()
        digest = weights_digest(final) if self.driver else None
        lora = cfg.trainer.lora
        if cfg.checkpoint.export_final and lora.enabled:  # the adapters; the merged weights on request
            from hpc_rl.ckpt.export_lora import export_adapter

            out = export_adapter(self.trainer.backend, RunDir(self.ctx.run_dir).final_adapter, cfg.model.path,
                                 group=self.ctx.groups.role)
            if self.driver:
                self.log.info("LoRA adapters exported to %s (a PEFT adapter directory)", out)
        if cfg.checkpoint.export_final and (not lora.enabled or lora.export_merged):
            from hpc_rl.ckpt.export import carried_note, export_hf

            out = export_hf(self.trainer.backend, RunDir(self.ctx.run_dir).final_hf, tokenizer_dir=cfg.model.path,
                            group=self.ctx.groups.role, overwrite=True, state=final)
            if self.driver:
                self.log.info("trained weights exported to %s (Hugging Face safetensors)%s", out, carried_note(out))
        summary = None
        if self.driver:
            self.collector.order(END, cfg.run.max_steps, [])
            summary = summarize(self.ctx.run_dir, {"algo": cfg.algo.name, "recipe": cfg.recipe, "model": cfg.model.name,
                                                   "model_params_b": cfg.model.params_b,
                                                   "final_weights_sha256": digest, "restarts": self.ctx.ident.restart})
            progress.update(cfg.run.max_steps + 1, "done", done_steps=cfg.run.max_steps)
        return {"role": self.ctx.ident.role, "rank": self.ctx.ident.role_rank, "steps": steps, "summary": summary}


def check_age_bound(batch, step: int, bound: int) -> None:
    """Lock-step collections are sampled by this step's policy (age 0): the bound holds by
    construction; a sample that breaks it means the refit protocol broke."""
    oldest = step - 1 - min(r.version_first for r in batch.rows)
    if oldest > bound:
        raise RuntimeError(f"step {step}: a sample is {oldest} steps old, over algo.async_rollout.max_trajectory_age_steps={bound}")


def weights_digest(state: Dict[str, torch.Tensor]) -> str:
    """sha256 of the trained weights (each name and its bytes, in name order): resumed runs compare equal bit for bit."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def run(ctx) -> Dict[str, Any]:
    routes = Routes.from_plan(ctx.plan)
    if not routes.generators:
        raise RuntimeError("the RL loop needs a generator role")
    if ctx.ident.role == ctx.plan.roles[0].name:
        result = RLLoop(ctx, routes).run()
    else:
        result = serve_role(ctx, routes)
    # every rank's traffic, for bench/exchange.py and the run's records
    out = ctx.run_dir / "exchange" / f"{ctx.ident.role.replace('/', '-')}.{ctx.ident.role_rank}.{ctx.ident.restart}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(exchange.traffic(), sort_keys=True) + "\n")
    driver = ctx.ident.global_rank == routes.driver
    if driver:
        announce_end(ctx)
    ctx.finish()  # before the final barrier: no peer sees this rank go quiet first
    if ctx.heartbeat is not None:
        ctx.heartbeat.stop()  # its last read of the store counts in the report below
    # what this rank (and its engine's workers) rejected: the driver sums every rank's report
    auth_stats.write_rank_report(ctx.run_dir, ctx.ident.role, ctx.ident.role_rank, ctx.ident.restart)
    dist.barrier(group=ctx.groups.world)
    if driver and isinstance(result, dict) and result.get("summary") is not None:
        result["summary"] = update_summary(ctx.run_dir, auth_stats.job_totals(ctx.run_dir, ctx.plan,
                                                                              ctx.ident.restart))
    return result

"""The trainer role: the student on its training backend. Its ranks run the orchestration
(hpc_rl/rl/loop.py) and ask this module for the student's log-probs, the train step and
the refit of the generators' engines."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from hpc_rl.algo import (aggregate, denominator, grpo_advantages, importance_weights, masked_mean, opd_advantages,
                         per_token, policy_loss_tokens, sequence_keep_mask)
from hpc_rl.models.backend import BackendSpec, TrainingBackend, parallel_sizes
from hpc_rl.models.registry import build_backend
from hpc_rl.roles import loss_terms, zero_advantage
from hpc_rl.roles.old_logprobs import SEPARATE_PASS, TRAINING_FORWARD, ForwardLogprobs, separate_pass_reason
from hpc_rl.precision import vllm_dtype
from hpc_rl.refit.vllm_engine import SampleRow, pad_rows
from hpc_rl.messaging import p2p as exchange
from hpc_rl.messaging.messages import Batch
from hpc_rl.messaging.routes import Routes


class TrainerRole:
    def __init__(self, ctx, routes: Routes, pad_id: int):
        cfg = ctx.cfg
        self.ctx, self.cfg, self.routes, self.pad_id, self.log = ctx, cfg, routes, pad_id, ctx.log
        self.rank = ctx.ident.role_rank
        self.is_driver = ctx.ident.global_rank == routes.driver
        self.backend: TrainingBackend = build_backend(cfg.trainer.backend, BackendSpec(
            cfg.model.path, cfg.trainer.precision, ctx.device, ctx.groups.role, train=cfg.trainer,
            parallel=parallel_sizes(cfg.trainer.parallel), sequence_parallel=cfg.trainer.sequence_parallel,
            logprob_chunk_tokens=cfg.trainer.logprob_chunk_tokens, logprob_batch_tokens=cfg.trainer.logprob_batch_tokens,
            activation_checkpointing=cfg.trainer.activation_checkpointing, packing=cfg.trainer.packing,
            micro_batch_tokens=cfg.trainer.micro_batch_tokens or cfg.trainer.max_seq_len,
            cpu_offload=cfg.trainer.cpu_offload, attn_implementation=cfg.trainer.attn_implementation))
        p = cfg.trainer.parallel
        # the checkpoint's HF class in the log: which model family the run really trains
        arch = ",".join(json.loads((Path(cfg.model.path) / "config.json").read_text()).get("architectures") or ["?"])
        self.log.info("student %s (%s) loaded (%s over %d ranks: dp %d x cp %d x tp %d%s, %s)", cfg.model.path, arch,
                      cfg.trainer.backend, dist.get_world_size(ctx.groups.role), self.backend.dp_size,
                      p.cp, p.tp, f", expert parallel {p.ep}" if p.ep > 1 else "", cfg.trainer.precision)
        if cfg.trainer.lora.enabled:  # what trains, and what the engines get (models/lora.py)
            from hpc_rl.models.lora import summary

            self.log.info("%s; refit sends the %s weights", summary(self.backend.model), cfg.trainer.lora.refit)
        self.refit_ep = None
        self.adapter_prefix, self.adapter_refits = None, 0  # trainer.lora.refit=adapter: no refit plan
        self._refit_cast = self._refit_want = None

    # ------------------------------------------------------------------------------- refit
    def join_refit(self, domain_of: Optional[Dict[int, str]]) -> None:
        """The refit group: every trainer rank (its shards) and each engine's workers. The
        driver describes both layouts and sends the setup to every generator; the trainer
        ranks get it inside their group; every member rebuilds the same plan from it."""
        from hpc_rl.models.families import hf_config
        from hpc_rl.refit.session import RefitEndpoint
        from hpc_rl.refit.transports import make_transport
        from hpc_rl.refit.engine_group import refit_setup
        from hpc_rl.refit.vllm_layout import wire_specs

        cfg, r = self.cfg, self.routes
        if cfg.trainer.lora.enabled and cfg.trainer.lora.refit == "adapter":  # the adapters alone travel
            from hpc_rl.refit.adapter_refit import publish

            self.adapter_prefix = f"lora_refit/{self.ctx.ident.restart}"
            if self.is_driver:
                for g in r.generators:
                    exchange.send({"adapter_prefix": self.adapter_prefix}, g)
            # refit 0: the adapter as built (B = 0, the base's outputs; a resume refits after loading),
            # which the engines load at once, so every request carries it (refit/adapter_refit.py)
            publish(self.backend, self.ctx.run_dir, self.adapter_prefix, 0, self.is_driver, self.ctx.store,
                    self.backend.checkpoint_dir)
            return
        setup = None
        engine_dtype = vllm_dtype(cfg.generator.precision)
        # what each trainer rank holds, read from its live parameters (a collective of the trainer ranks)
        src = self.backend.source_layout(engine_dtype)
        if self.is_driver:
            specs = wire_specs(self.backend.refit_specs(), engine_dtype)
            setup = refit_setup(specs, len(r.trainer), len(r.generators), f"refit/{self.ctx.ident.restart}",
                                timeout_s=cfg.refit.timeout_s, bucket_bytes=cfg.refit.bucket_mb << 20,
                                transport=cfg.refit.transport, domain_of=domain_of,
                                engine_tp=cfg.generator.parallel.tp, src=src, engine_ep=cfg.generator.parallel.ep > 1,
                                hf_config=hf_config(cfg.model.path))
            for g in r.generators:
                exchange.send(setup, g)
        setup = exchange.share(setup, r.driver, self.ctx.groups.role)
        transport = make_transport(setup.transport, self.ctx.store, setup.prefix, self.rank, setup.world,
                                   setup.names, setup.timeout_s, cuda=self.ctx.device.startswith("cuda"))
        self.refit_ep = RefitEndpoint(setup, self.rank, transport, sources=self._refit_sources())
        if self.is_driver:
            stats = self.refit_ep.plan.stats
            self.log.info("refit plan: %d transfers in %d buckets, %.1f MB (%s)", stats["transfers"], stats["buckets"],
                          stats["bytes"] / 1e6, "domains from the placement" if domain_of else "no domain map")

    def _refit_sources(self):
        """This rank's shards in the dtypes the refit sends (the engine's, float32 for what vLLM
        keeps so: vllm_layout.wire_specs): the live parameters when the dtypes agree, else cast
        copies kept between refits (so the prepared walk stays valid)."""
        from hpc_rl.refit.vllm_layout import wire_specs

        live = self.backend.local_shards()
        if self._refit_want is None:
            wire = wire_specs({n: (t.shape, t.dtype) for n, (_, t) in live.items()}, vllm_dtype(self.cfg.generator.precision))
            self._refit_want = {n: getattr(torch, d) for n, (_, d) in wire.items()}
        # the rank's device too: with trainer.cpu_offload (fsdp2) the shards live in host memory,
        # and the GPU transports (NCCL, CUDA IPC) send from device memory
        device = torch.device(self.ctx.device)
        if all(t.dtype == self._refit_want[n] and t.device == device for n, (_, t) in live.items()):
            return {self.rank: live}
        if self._refit_cast is None:
            self._refit_cast = {n: (start, t.to(device=device, dtype=self._refit_want[n])) for n, (start, t) in live.items()}
        else:
            for n, (_, t) in live.items():
                self._refit_cast[n][1].copy_(t)
        return {self.rank: self._refit_cast}

    def refit(self) -> float:
        """Send this rank's shards along the refit plan (the driver has ordered the engines
        to receive). Raises RefitError naming a peer that died or is late."""
        t0 = time.perf_counter()
        if self.adapter_prefix is not None:  # trainer.lora.refit=adapter (refit/adapter_refit.py)
            from hpc_rl.refit.adapter_refit import publish

            self.adapter_refits += 1
            self.ctx.set_phase("refit")
            publish(self.backend, self.ctx.run_dir, self.adapter_prefix, self.adapter_refits, self.is_driver,
                    self.ctx.store, self.backend.checkpoint_dir)
            return time.perf_counter() - t0
        self.refit_ep.set_sources(self._refit_sources())
        # waiting for the engines to be ready (still sampling, under async rollouts) is a wait
        # phase, so the progress watchdog names the engine that is stuck, not this rank
        self.ctx.set_phase("wait_refit")
        self.refit_ep.run(self.cfg.refit.timeout_s, on_ready=lambda: self.ctx.set_phase("refit"))
        return time.perf_counter() - t0

    # --------------------------------------------------------------------------- logprobs
    def reference_logprobs(self, rows: List[SampleRow]) -> torch.Tensor:
        """[B, T] the reference model's log-probs with trainer.lora: the student's base, its adapters
        off for the pass (models/lora.py adapters_off; every rank alike), the same no-grad pass."""
        from hpc_rl.models.lora import adapters_off

        with adapters_off(self.backend.model):
            return self.student_logprobs(rows)

    def student_logprobs(self, rows: List[SampleRow]) -> torch.Tensor:
        """[B, T] student log-probs of the whole batch: each trainer rank computes its
        strided share, then the ranks exchange shares."""
        longest = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
        if longest > self.cfg.trainer.max_seq_len:  # validation keeps the engine's limit below it
            raise RuntimeError(f"a sampled sequence has {longest} tokens, more than trainer.max_seq_len="
                               f"{self.cfg.trainer.max_seq_len}; set generator.max_model_len <= trainer.max_seq_len")
        full = pad_rows(rows, self.pad_id)
        n_tr = self.backend.dp_size
        mine = exchange.strided(len(rows), self.backend.dp_rank, n_tr)
        lp = self.backend.logprobs(full.input_ids[mine], full.attention_mask[mine]).float().cpu()
        if dist.get_world_size(self.ctx.groups.role) == 1:
            return lp
        # the ranks of one data-parallel rank (its tensor parallel ranks) hold the same share
        out = torch.zeros(full.input_ids.shape, dtype=torch.float32)
        # several ranks of one data-parallel index (tensor/context/model parallel) return the
        # same rows: place each share by its sender's dp rank
        for dp_rank, t in exchange.gather_all((self.backend.dp_rank, lp), self.ctx.groups.role):
            out[exchange.strided(len(rows), dp_rank, n_tr)] = t
        return out

    # ------------------------------------------------------------------------------ train
    def advantages(self, b: Batch, metrics: Optional[Dict[str, float]] = None) -> torch.Tensor:
        """[B, T] advantages; the reward shaping's figures go into `metrics` when given."""
        mask = b.rollouts.response_mask
        if self.cfg.algo.name == "mopd":
            o = self.cfg.algo.opd
            return opd_advantages(b.teacher_logprobs, b.student_logprobs, mask, o.adv_clip, o.baseline)
        g = self.cfg.algo.grpo
        # groups are the collection's items; a sibling sample takes its episode's advantage.
        # The rewards after DAPO's overlong shaping and a reference KL in the reward (loss_terms.py).
        rewards, shaping = loss_terms.shaped_rewards(self.cfg, b)
        if metrics is not None:
            metrics.update(shaping)
        adv = grpo_advantages(rewards, self.cfg.algo.generations_per_prompt, g.leave_one_out, g.normalize_std,
                              clip=(g.adv_clip_low, g.adv_clip_high))
        if b.sibling_of:
            adv = torch.cat([adv, adv[torch.tensor(b.sibling_of)]])
        return per_token(adv, mask)

    def old_logprobs_reason(self, rows: List[SampleRow], version: Optional[int]) -> Optional[str]:
        """Why a training batch of `rows` needs the separate log-prob pass; None: its training
        forward gives the old log-probs (roles/old_logprobs.py). Every trainer rank decides alike."""
        return separate_pass_reason(self.cfg, rows, version, self.backend.dp_size,
                                    getattr(self.backend, "old_logprobs_from_train_forward", False))

    def train(self, b: Batch) -> Dict[str, Any]:
        """One optimizer step per `trainer.global_batch_size` minibatch; each data-parallel
        rank takes its strided rows of the minibatch in `trainer.micro_batch_size` pieces.
        Without `b.student_logprobs` (the collection skipped the separate pass) each
        micro-batch takes its old log-probs from its own forward, detached; where the
        conditions do not hold the separate pass runs here."""
        a, tr = self.cfg.algo, self.cfg.trainer
        r = b.rollouts
        mask = r.response_mask
        mm = a.mismatch
        path, logprobs_s, ref_s = SEPARATE_PASS, 0.0, 0.0
        if loss_terms.reference_on_trainer(self.cfg) and b.ref_logprobs is None:
            # trainer.lora: the reference is the base with the adapters off, scored here before the
            # advantages (apply_to=reward) and the loss (apply_to=loss); no teacher group serves it
            t0 = time.perf_counter()
            b.ref_logprobs = self.reference_logprobs(b.rows)
            ref_s = time.perf_counter() - t0
        if b.student_logprobs is None:
            if self.old_logprobs_reason(b.rows, None) is None:
                path = TRAINING_FORWARD
            else:  # a caller left it out where the shortcut would change the math
                t0 = time.perf_counter()
                b.student_logprobs = self.student_logprobs(b.rows)
                logprobs_s = time.perf_counter() - t0
        fwd = ForwardLogprobs() if path == TRAINING_FORWARD else None
        # DAPO's overlong filtering: samples cut at max_tokens train nothing (their rewards count)
        loss_mask, filtered = loss_terms.trained_tokens(self.cfg, b, mask)
        shaping: Dict[str, float] = {}  # the reward shaping's figures (loss_terms.shaped_rewards)
        if fwd is None:
            adv = b.advantages = self.advantages(b, shaping)
            weights = importance_weights(b.student_logprobs, r.generation_logprobs, mask, mm.kind, mm.min, mm.max)
            keep_seq = sequence_keep_mask(b.student_logprobs, r.generation_logprobs, mask, mm.seq_logprob_error_threshold)
            train_mask = loss_mask & keep_seq[:, None]
        else:  # GRPO's advantages need no log-probs; MOPD's come per micro-batch (baseline none)
            adv = self.advantages(b, shaping) if a.name != "mopd" else None
            train_mask = loss_mask
        n, dp = len(b.rows), self.backend.dp_size
        metrics: List[Dict[str, float]] = []
        # rows that train nothing (advantage 0 on every trained token) are left out (zero_advantage.py)
        skip_off = zero_advantage.skip_off_reason(self.cfg, adv, fwd is not None)
        trains = zero_advantage.trains_something(adv, train_mask) if skip_off is None else None
        trained: List[int] = []
        for start in range(0, n, tr.global_batch_size):
            rows = list(range(start, min(start + tr.global_batch_size, n)))
            idx = torch.tensor(rows[self.backend.dp_rank::dp])
            # the rank's share's tokens or sequences: the loss's denominator (aggregation.py; with the
            # threshold the shortcut runs one micro-batch per rank, which computes its own: None),
            # counted over the whole share before rows that train nothing are left out
            denom = denominator(train_mask[idx], a.loss.aggregation)
            if fwd is not None and mm.seq_logprob_error_threshold is not None:
                denom = None
            if trains is not None:
                mine, every = zero_advantage.rows_to_train(rows, dp, self.backend.dp_rank, trains)
                idx, trained = torch.tensor(mine, dtype=torch.long), trained + every

            def loss_fn(lp, rows, idx=idx, denom=denom):
                i = idx[rows]
                if fwd is None:
                    old, adv_i, w_i, tm_i = b.student_logprobs[i], adv[i], weights[i], train_mask[i]
                else:  # the same functions over the micro-batch's rows: elementwise / per row
                    old = fwd.keep(i, lp)
                    gen = r.generation_logprobs[i]
                    adv_i = adv[i] if adv is not None else opd_advantages(
                        b.teacher_logprobs[i], old, mask[i], a.opd.adv_clip, a.opd.baseline)
                    w_i = importance_weights(old, gen, mask[i], mm.kind, mm.min, mm.max)
                    tm_i = loss_mask[i] & sequence_keep_mask(old, gen, mask[i], mm.seq_logprob_error_threshold)[:, None]
                loss_t, m = policy_loss_tokens(lp, old, adv_i, tm_i, kind=a.loss.kind, clip_low=a.loss.ratio_clip_low,
                                               clip_high=a.loss.ratio_clip_high, weights=w_i,
                                               ratio_level=a.loss.ratio_level)
                kl_t, kl_m = loss_terms.kl_loss_term(self.cfg, lp, b, i, tm_i)
                if kl_t is not None:
                    loss_t = loss_t + kl_t
                # the micro-batch's part of the share's loss: its numerator over the share's denominator
                return aggregate(loss_t, tm_i, a.loss.aggregation, denom), dict(m, **kl_m)

            metrics.append(self.backend.train_step(r.input_ids[idx], r.attention_mask[idx], loss_fn,
                                                   micro_batch_size=tr.micro_batch_size))
        if fwd is not None:  # the whole batch's, for the records and the metrics below
            b.student_logprobs = fwd.whole(tuple(mask.shape), self.ctx.groups.role,
                                           dist.get_world_size(self.ctx.groups.role))
            if trains is not None:  # a row left out has no trainer log-probs: NaN in the records
                left_out = torch.ones(n, dtype=torch.bool)
                left_out[torch.tensor(trained, dtype=torch.long)] = False
                b.student_logprobs[left_out] = float("nan")
            # MOPD's advantages need the whole batch's log-probs; GRPO's were computed before the step
            adv = b.advantages = adv if adv is not None else self.advantages(b)
            keep_seq = sequence_keep_mask(b.student_logprobs, r.generation_logprobs, mask, mm.seq_logprob_error_threshold)
        # the ranks agree on every skip (models/nonfinite.py): counted, not averaged
        skipped = sum(int(m.pop("nonfinite_skipped")) for m in metrics)
        skipped_total = [int(m.pop("nonfinite_skipped_total")) for m in metrics][-1]
        out = {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}
        ranks = dist.get_world_size(self.ctx.groups.role)
        if ranks > 1:  # average the ranks' minibatch metrics (tensor parallel ranks repeat their dp rank's)
            keys = sorted(out)
            v = torch.tensor([out[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(v, group=self.ctx.groups.role)
            out = {k: float(x) / ranks for k, x in zip(keys, v)}
        out["advantage_mean"] = float(masked_mean(adv, mask))
        out.update(shaping, **filtered, **loss_terms.ref_kl_metric(self.cfg, b, train_mask))
        out["seqs_masked_by_mismatch"] = int((~keep_seq).sum())
        out["optimizer_steps"] = len(metrics)
        out["nonfinite_skipped"], out["nonfinite_skipped_total"] = skipped, skipped_total
        # which pass gave the old log-probs (roles/old_logprobs.py); a late separate pass's seconds
        out["old_logprobs_path"] = path
        out["samples_trained"] = len(trained) if trains is not None else n
        if skip_off is not None:
            out["zero_advantage_kept_because"] = skip_off
        if logprobs_s:
            out["late_logprobs_s"] = logprobs_s
        if ref_s:
            out["ref_logprobs_s"] = ref_s
        return out

"""Checkpoints of the trainer ranks: periodic saves that fit before the job's end, and the
resume from the newest complete checkpoint (model, optimizer, prompt iterator, RNGs).
Generators get the resumed weights by a refit, ordered by the loop."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from hpc_rl.data.dataset import PromptIterator
from hpc_rl.ft.preemption import save_fits
from hpc_rl.rundir import RunDir
from hpc_rl.runtime.env import RankEnv
from hpc_rl.runtime.faults import maybe_inject

from hpc_rl.messaging import p2p as exchange
from .records import MetricsLog, RolloutStore


class Checkpointer:
    def __init__(self, ctx, trainer):
        self.ctx, self.cfg, self.trainer, self.log = ctx, ctx.cfg, trainer, ctx.log
        self.is_driver = trainer.is_driver
        self.root = Path(self.cfg.checkpoint.dir) if self.cfg.checkpoint.dir else RunDir(ctx.run_dir).checkpoints
        self.last_saved = 0
        self.last_save_s: Optional[float] = None
        self.resumed_extra: dict = {}  # the extra state of the checkpoint resumed from (its rollout buffer)

    def due(self, step: int) -> bool:
        """checkpoint.every_steps, the last step, and with keep_best every validation step: a
        checkpoint the validation's metric can rank (ckpt/retention.py)."""
        ck, d = self.cfg.checkpoint, self.cfg.data
        every_val = d.validation.every_steps if ck.keep_best > 0 and d.eval_prompts_per_task > 0 else 0
        return step % ck.every_steps == 0 or step == self.cfg.run.max_steps or bool(every_val and step % every_val == 0)

    def retain(self) -> None:
        from hpc_rl.ckpt import apply_retention

        ck = self.cfg.checkpoint
        apply_retention(self.root, ck.keep_last, ck.keep_every, keep_best=ck.keep_best, best_metric=ck.best_metric,
                        best_mode=ck.best_mode)

    def record_validation(self, step: int, record: Optional[dict]) -> None:
        """The driver writes a validation's metrics beside the checkpoint of its step (if one
        was saved: the start's step 0 has none, a save can be skipped for time), then applies
        retention again: the save's own retention ran before the metric existed. On disk with
        the checkpoint, the metric outlives a requeue."""
        from hpc_rl.ckpt.retention import write_validation
        from hpc_rl.observe.metrics import flatten

        if not self.is_driver or record is None or self.cfg.checkpoint.keep_best <= 0 or step != self.last_saved:
            return
        if write_validation(self.root, step, flatten(record)[1]) is not None:
            self.retain()

    def save(self, step: int, it: PromptIterator, more: Optional[dict] = None) -> None:
        """Every trainer rank calls it; the driver decides whether the save fits in time."""
        from hpc_rl.ckpt import capture_rng_state, save_checkpoint

        cfg, group = self.cfg, self.ctx.groups.role
        go = save_fits(RankEnv.from_env().job_end, time.time(), cfg.ft.save_margin_s, self.last_save_s) \
            if self.is_driver else None
        if not exchange.share(go, self.trainer.routes.driver, group):
            if self.is_driver:
                self.log.warning("step %d: checkpoint skipped, it would not finish %.0fs before the job's end "
                                 "(last save took %.1fs)", step, cfg.ft.save_margin_s, self.last_save_s or 0.0)
            return
        t0 = time.time()
        extra = {"step": step, "iterator": it.state_dict(), "rng": capture_rng_state(), **(more or {})}
        ident = self.ctx.ident
        save_checkpoint(self.root, step, self.trainer.backend, extra, RunDir(self.ctx.run_dir).config.read_text(),
                        group=group, recipe=cfg.recipe,
                        before_publish=lambda: maybe_inject(cfg.ft.inject_failure, ident.role, ident.role_rank,
                                                            ident.restart, f"save{step}"))
        self.last_save_s = time.time() - t0
        if self.is_driver:
            self.retain()
        self.last_saved = step

    def resume(self, it: PromptIterator) -> int:
        """The last completed step: 0, or the newest complete checkpoint's step (every
        trainer rank loads it)."""
        from hpc_rl.ckpt import MixedRunsError, find_resumable, fresh_start_conflict, fresh_start_fix, load_checkpoint, \
            model_fingerprint, restore_rng_state

        run_dir = self.ctx.run_dir
        # checkpoint.resume=false starts fresh on the first attempt only: the launch refused
        # checkpoints already there (rl/inputs.py), so a requeue's are this run's own, and
        # starting it at step 0 again would leave them newer than its saves (retention then
        # deletes the saves)
        if not self.cfg.checkpoint.resume and self.ctx.ident.restart == 0:
            conflict = None
            if self.is_driver:
                conflict = fresh_start_conflict(self.root)  # another launch wrote there since ours was checked
                conflict = f"checkpoint.resume=false: {conflict}; {fresh_start_fix(self.root)}" if conflict else None
            conflict = exchange.share(conflict, self.trainer.routes.driver, self.ctx.groups.role)
            if conflict:
                raise MixedRunsError(conflict)
            if self.is_driver:
                self._truncate_records(0)
                self.log.info("checkpoint.resume=false: starting fresh; checkpoints go to %s", self.root)
            return 0
        found = None
        if self.is_driver:
            scan = find_resumable(self.root, model_fingerprint(self.trainer.backend.model), self.cfg.recipe)
            for path, why in scan.skipped:
                self.log.warning("skipped checkpoint %s: %s", path, why)
            found = (str(scan.path), scan.step) if scan else None
        found = exchange.share(found, self.trainer.routes.driver, self.ctx.groups.role)
        if found is None:
            if self.is_driver:  # a requeue that never saved starts over: its records too
                self._truncate_records(0)
            return 0
        path, step = found
        extra = load_checkpoint(path, self.trainer.backend, group=self.ctx.groups.role)
        it.load_state_dict(extra["iterator"])
        restore_rng_state(extra["rng"])
        self.resumed_extra = extra
        if self.is_driver:
            recomputed = self._truncate_records(step)
            self.log.info("restart %d resumed from %s (step %d); %d completed steps after it will be recomputed",
                          self.ctx.ident.restart, path, step, recomputed)
            with RunDir(run_dir).restarts.open("a") as f:
                f.write(json.dumps({"restart": self.ctx.ident.restart, "resumed_from_step": step, "checkpoint": path,
                                    "steps_recomputed": recomputed, "time": time.time()}) + "\n")
                f.flush()
                os.fsync(f.fileno())  # the resume history outlives a node crash
        self.last_saved = step
        return step

    def _truncate_records(self, step: int) -> int:
        """metrics.jsonl and rollouts.h5 after `step` go (recomputed); torn or damaged parts are
        dropped and named in the log (rl/records.py). Returns the training steps dropped."""
        dropped = MetricsLog(self.ctx.run_dir).truncate_after(step)
        RolloutStore(self.ctx.run_dir).truncate_after(step)
        return dropped

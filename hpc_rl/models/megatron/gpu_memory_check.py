"""The memory savers' stage of the Megatron GPU check (gpu_check.py, tests/gpu/megatron_check.sh).

One train step of a fresh backend per variant, on the same checkpoint and batch: plain, full
recompute of every layer (trainer.activation_checkpointing, megatron-core's full/uniform/1), and
the optimizer's CPU offload (trainer.megatron.optimizer_cpu_offload, fraction 1, AdamW). Each
records its loss, grad norm, the change of its weights against the plain step's, and the peak
device memory of its step (torch.cuda.max_memory_allocated after a reset, less what was
allocated before the backend was built).

  recompute: the same forward, so the same loss (goal: relative difference <= 1e-6); the
             weights after the step within 1% of the plain step's update (bf16 backward)
  offload:   the same forward and loss; the update within 1% of the plain step's (fp32 AdamW on
             the CPU instead of the GPU's)

A node without Transformer Engine has no precision-aware optimizer in megatron-core 0.16.1: the
backend refuses the offload variant there (models/megatron/memory.py), recorded as refused.
NOT RUN on a GPU yet (no GPU lent to this round).
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Dict

GOALS = {"loss_rel": 1e-6, "update_rel": 0.01}


def _shards(backend) -> Dict[str, Any]:
    return {k: t.detach().float().cpu().clone() for k, (_, t) in backend.local_shards().items()}


def run_variants(ckpt: str, batch: Dict[str, Any], loss_fn: Callable, make_train: Callable[..., Any]) -> Dict[str, Any]:
    """`make_train(**overrides)`: a TrainerConfig for the variant. Returns the JSON's section."""
    import torch
    import torch.distributed as dist

    from hpc_rl.models.backend import parallel_sizes
    from hpc_rl.models.megatron.backend import MegatronBackend

    variants = {"plain": {}, "full_recompute": {"activation_checkpointing": True},
                "optimizer_offload": {"megatron": {"optimizer_cpu_offload": True}}}
    out: Dict[str, Any] = {"goals": GOALS}
    before = after_plain = None
    for name, overrides in variants.items():
        gc.collect()  # the previous variant's backend (its optimizer and config refer to each other)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        train = make_train(**overrides)
        try:
            backend = MegatronBackend(ckpt, dist.group.WORLD, "bf16", "cuda:0", train=train,
                                      parallel=parallel_sizes(train.parallel))
        except ValueError as exc:  # a refusal naming what the node lacks (Transformer Engine)
            out[name] = {"refused": str(exc)}
            continue
        start = _shards(backend)
        before = start if before is None else before
        torch.cuda.reset_peak_memory_stats()
        step = backend.train_step(batch["input_ids"], batch["attention_mask"], loss_fn, micro_batch_size=4)
        peak = torch.cuda.max_memory_allocated() - base
        after = _shards(backend)
        row = {"loss": step["loss"], "grad_norm": step["grad_norm"], "peak_step_bytes": int(peak),
               "recompute_granularity": backend.tcfg.recompute_granularity,
               "same_start": all(torch.equal(start[k], before[k]) for k in start)}
        if name == "plain":
            after_plain = after
        elif after_plain is not None:
            plain = out["plain"]
            row["loss_rel"] = abs(step["loss"] - plain["loss"]) / max(abs(plain["loss"]), 1e-12)
            update = max(float((after_plain[k] - before[k]).abs().max()) for k in before)
            row["update_rel"] = max(float((after[k] - after_plain[k]).abs().max()) for k in before) / max(update, 1e-12)
            row["peak_vs_plain"] = peak / max(plain["peak_step_bytes"], 1)
            row["passed"] = (row["same_start"] and row["loss_rel"] <= GOALS["loss_rel"]
                             and row["update_rel"] <= GOALS["update_rel"])
        out[name] = row
        del backend
    out["passed"] = all(v.get("passed", True) for k, v in out.items() if isinstance(v, dict) and k != "goals"
                        and "refused" not in v) and "loss" in out.get("plain", {})
    return out

"""Non-finite optimizer steps: skipped, counted, and fatal after too many in a row.

A NaN or inf in the loss or the gradients (a non-finite reward or advantage that got
through, an overflow, a bad kernel) passes clip_grad_norm_ (a NaN norm clips nothing) and
Adam, and turns every weight into NaN; the refit then sends them to the engines and the
checkpoints keep them. Both training backends (models/fsdp2.py, models/megatron/backend.py)
ask one `NonFiniteGuard` before each optimizer step:

  - each trainer rank's verdict is all-reduced over the backend's group, so every rank
    skips or steps together: a rank that stepped alone would leave its FSDP shards (or its
    part of Megatron's distributed optimizer) out of step with the others' for good;
  - a skipped step applies nothing: the gradients are dropped and neither the optimizer's
    state nor the learning-rate schedule's position (the backend's `step_count`) moves. The
    schedule counts applied updates, as Megatron's own training loop does; the ranks cannot
    disagree on it because they agree on every skip;
  - the step's metrics say so (`nonfinite_skipped`, `nonfinite_skipped_total`) and every
    rank logs a warning;
  - one more than `trainer.max_nonfinite_steps` in a row raises NonFiniteStepsError on every
    rank at the same step (no rank is left waiting in a collective the others have left).
"""

from __future__ import annotations

import logging
from typing import Dict, Iterable, Optional, Union

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# what the key and the likely causes are called in the error (one place)
KEY = "trainer.max_nonfinite_steps"


class NonFiniteStepsError(FloatingPointError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm. `no_retry`:
    the batch shell does not requeue (runtime/worker.py writes errors/fatal.<restart>.txt): a
    resumed run replays the same prompts with the same seeds from the last checkpoint."""

    no_retry = True


def tensors_finite(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor: every element of every tensor is finite. One float64 sum per tensor
    (a NaN or inf anywhere makes it non-finite; float64 cannot overflow on finite float32
    values), kept on the device: no host sync per tensor and no tensor-sized temporary."""
    total: Optional[torch.Tensor] = None
    for t in tensors:
        if hasattr(t, "to_local"):  # a DTensor: this rank's shard (the group agrees below)
            t = t.to_local()
        if not t.is_floating_point() or t.numel() == 0:
            continue
        s = t.detach().sum(dtype=torch.float64)
        total = s if total is None else total + s
    return torch.tensor(True) if total is None else torch.isfinite(total)


def all_ranks_finite(ok: Union[bool, torch.Tensor], group: Optional[dist.ProcessGroup], device) -> bool:
    """Whether `ok` holds on every rank of `group` (a collective of the group; None or a
    group of one: this rank alone)."""
    bad = torch.logical_not(torch.as_tensor(ok).to(device)).to(torch.float32).reshape(1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return not bool(bad.item())


class NonFiniteGuard:
    """One training backend's count of skipped optimizer steps (the same on every rank of its
    group). `limit`: trainer.max_nonfinite_steps, the skips allowed in a row."""

    def __init__(self, limit: int, group: Optional[dist.ProcessGroup] = None, device="cpu"):
        if limit < 0:
            raise ValueError(f"{KEY} must be >= 0, got {limit}")
        self.limit, self.group, self.device = limit, group, torch.device(device)
        self.steps = 0  # optimizer steps judged (applied or skipped), this process
        self.in_a_row = 0
        self.skipped_total = 0

    def agree(self, ok: Union[bool, torch.Tensor]) -> bool:
        """Whether every rank found its loss and gradients finite (a collective of the group)."""
        return all_ranks_finite(ok, self.group, self.device)

    def record(self, finite: bool, detail: str) -> Dict[str, float]:
        """Count one optimizer step the ranks agreed on, after the backend applied or dropped
        it; raises NonFiniteStepsError past the limit. `detail`: this rank's loss and norm."""
        self.steps += 1
        if finite:
            self.in_a_row = 0
        else:
            self.in_a_row += 1
            self.skipped_total += 1
            if self.in_a_row > self.limit:
                raise NonFiniteStepsError(
                    f"{self.in_a_row} optimizer steps in a row (up to optimizer step {self.steps} of this process) had a "
                    f"non-finite loss or gradient norm on a trainer rank (this rank: {detail}); none was applied, and "
                    f"more than {KEY}={self.limit} in a row stop the run. Likely causes: non-finite rewards or "
                    f"advantages (see the env ranks' logs and the steps' reward_mean in metrics.jsonl), or updates "
                    f"that overflow (lower trainer.optimizer.lr, use trainer.precision=bf16 or fp32). The weights are "
                    f"the last finite ones, and checkpoint retention keeps the newest finite checkpoint. Raise {KEY} "
                    f"to skip more in a row.")
            log.warning("optimizer step %d skipped: non-finite loss or gradient norm on a trainer rank (this rank: %s); "
                        "%d in a row, %d in all (%s=%d)", self.steps, detail, self.in_a_row, self.skipped_total, KEY,
                        self.limit)
        return {"nonfinite_skipped": float(not finite), "nonfinite_skipped_total": float(self.skipped_total)}

    def state_dict(self) -> Dict[str, int]:
        return {"in_a_row": self.in_a_row, "skipped_total": self.skipped_total}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.in_a_row, self.skipped_total = int(state["in_a_row"]), int(state["skipped_total"])

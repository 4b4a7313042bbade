"""`TrainingBackend`: what the RL loop needs of a model that trains (the student) or only
scores (a teacher), and the registry `trainer.backend` selects from.

The loop never reaches into a backend's model: it asks for log-probs, a train step over
micro-batches, the refit source layout (this rank's shards) and checkpoint state (models/registry.py
selects the implementation). A
backend that cannot honour a config value is refused by validation
(`hpc_rl/config/support.py`) before anything is submitted, never here at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

LossFn = Callable[[torch.Tensor, Sequence[int]], Tuple[torch.Tensor, Dict[str, float]]]
Shards = Dict[str, Tuple[Tuple[int, ...], torch.Tensor]]  # name -> (global start of this rank's box, tensor)


@runtime_checkable
class TrainingBackend(Protocol):
    device: torch.device
    model: torch.nn.Module  # for checkpoints (distributed state dicts) and the HF export
    optimizer: Optional[torch.optim.Optimizer]
    step_count: int  # optimizer steps taken (the learning-rate schedule's position)
    # models/nonfinite.NonFiniteGuard of a training backend (None: inference only): skipped
    # non-finite steps, which step_count leaves out; checkpoints carry its counts
    nonfinite: Any
    # True when train_step's loss_fn gets every row's whole log-probs on every rank, so a batch
    # trained in one optimizer step may take its old log-probs from that forward, detached
    # (roles/old_logprobs.py); False: the separate pass always runs
    old_logprobs_from_train_forward: bool

    @property
    def dp_rank(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] log p(token i | tokens < i), 0 at position 0 (no gradient)."""

    def train_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_fn: LossFn,
                   micro_batch_size: int) -> Dict[str, float]:
        """One optimizer step over this rank's rows, in micro-batches of `micro_batch_size`
        rows whose gradients accumulate; `loss_fn(logprobs, rows)` is the micro-batch's
        loss already scaled to its share of the step. A non-finite loss or gradient on any
        rank skips the step on all of them (models/nonfinite.py; metric `nonfinite_skipped`)."""

    def greedy(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, eos_id: int,
               pad_id: int) -> torch.Tensor:
        """Greedy continuations of left-padded prompts (a teacher's own accuracy)."""

    def refit_specs(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """Every weight's global shape and dtype, by Hugging Face name."""

    def local_shards(self, dtype: Optional[torch.dtype] = None) -> Shards:
        """This rank's part of every weight: the refit source layout."""

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Every weight, whole, on CPU (a collective of the backend's ranks)."""

    def dp_rank_of(self, role_rank: int) -> int:
        """The data-parallel rank (the rows' share) of a rank of the backend's group."""

    def source_layout(self, dtype_name: str) -> Any:
        """The refit source Layout (hpc_rl.refit.layout) of the group, group ranks as layout
        ranks, from every rank's live shards (a collective of the backend's ranks)."""


@dataclass(frozen=True)
class BackendSpec:
    """What a role asks of a backend: the checkpoint, its ranks, and, when it trains, the
    trainer section of the config (optimizer, schedule, precision)."""

    checkpoint: str
    precision: str
    device: str
    group: Any  # the role's process group
    train: Any = None  # hpc_rl.config.schema.TrainerConfig, or None for inference only
    # the role's parallel sizes {"tp", "cp", "ep", "etp", "pp", "dp"} (None: all data parallel);
    # every backend builds its layout from these (fsdp2: dp x cp x tp mesh; megatron: its groups)
    parallel: Any = None
    sequence_parallel: bool = False  # tensor parallel shards the norms' tokens (trainer.sequence_parallel)
    # trainer.logprob_chunk_tokens / logprob_batch_tokens (None: the backend's default), for the
    # student and the teachers; trainer.activation_checkpointing, for the student only
    logprob_chunk_tokens: Any = None
    logprob_batch_tokens: Any = None
    activation_checkpointing: bool = False
    # trainer.packing (the student's train step and every no-grad log-prob pass, teachers' too) and
    # trainer.micro_batch_tokens (the student's packed micro-batches; None: one sample per row)
    packing: bool = False
    micro_batch_tokens: Any = None
    # trainer.attn_implementation (fsdp2, the student and the teachers; None: transformers' default)
    attn_implementation: Any = None
    # trainer.cpu_offload (fsdp2, the student only): FSDP2 keeps parameters, gradients and
    # optimizer state in host memory and steps the optimizer there
    cpu_offload: bool = False


def parallel_sizes(p: Any) -> Dict[str, Any]:
    """A role's `parallel` config section -> the sizes a backend builds its layout from."""
    return {"tp": p.tp, "cp": p.cp, "ep": p.ep, "etp": p.etp, "pp": p.pp, "dp": p.dp}

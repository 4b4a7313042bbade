"""The student's optimizer and learning-rate schedule (`trainer.optimizer`, `trainer.scheduler`)
and the trainer's memory keys (`trainer.logprob_*`, `trainer.activation_checkpointing`), beside schema.py.

Its comments document the keys like schema.py's do (hpc_rl/config/reference.py reads both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional

from .trace import Traced


@dataclass
class OptimizerConfig(Traced):
    name: Literal["adamw", "adam"] = "adamw"  # adamw: decoupled weight decay; adam: decay added to the gradient
    lr: float = 1e-6  # learning rate after warmup (constant from then on)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam's (beta1, beta2)
    eps: float = 1e-8  # Adam's epsilon
    weight_decay: float = 0.0  # weight decay coefficient
    grad_clip: float = 1.0  # gradients are clipped to this total L2 norm before each optimizer step


@dataclass
class SchedulerConfig(Traced):
    name: Literal["constant_with_warmup"] = "constant_with_warmup"  # the only schedule: linear warmup, then constant
    warmup_steps: int = 0  # optimizer steps of the warmup; 0: optimizer.lr from the first step
    warmup_start_lr: float = 0.0  # linear ramp from this to optimizer.lr over warmup_steps


@dataclass
class TrainerMemoryConfig(Traced):
    """The trainer's memory-saving keys (fields of `trainer`; TrainerConfig takes them from here)."""

    # Tokens per chunk of the log-prob head: the sampled tokens' log-probs come from the final hidden
    # states a chunk at a time (the backward recomputes each chunk's logits), so no [rows, tokens, vocab]
    # float32 logits exist (hpc_rl/models/chunked_logprobs.py). Applies to the student and the teachers.
    # A chunk holds tokens x vocab / tp float32 logits. None: sized by the vocabulary, 2^26 logits
    # (256 MB) per chunk on each rank (CHUNK_LOGIT_ELEMENTS: 512 tokens at a 128k vocabulary); 0: whole
    # logits at once. The megatron backend has its own vocab-parallel log-probs: set only with fsdp2.
    logprob_chunk_tokens: Optional[int] = None
    # Padded tokens per forward of the no-grad log-prob pass (the student's log-probs, the teachers'
    # scores): a rank's rows go through in forwards of max(1, this // row length) rows. None: fsdp2's
    # default, 16384 (DEFAULT_LOGPROB_BATCH_TOKENS); 0: all of a rank's rows in one forward. The
    # megatron backend's pass runs trainer.micro_batch_size rows at a time: set only with fsdp2.
    logprob_batch_tokens: Optional[int] = None
    # Recompute each decoder block's activations in the backward instead of keeping them (torch's
    # non-reentrant checkpoint per block, applied before FSDP2 shards it): less memory, about one more
    # forward of compute per train step. The student on fsdp2 only (teachers never run a backward).
    activation_checkpointing: bool = False
    # Sequence packing: several samples share one row, each with its own position ids; attention
    # never crosses samples (a block-diagonal mask on CPU, variable-length attention on GPUs) and
    # Nemotron-H's Mamba state restarts at every sample (hpc_rl/models/packing.py). Train
    # micro-batches are then formed by trainer.micro_batch_tokens (not micro_batch_size rows) and
    # the no-grad log-prob pass packs rows of up to logprob_batch_tokens tokens; the loss is the
    # unpacked loss. The student and the teachers on fsdp2, without context parallel.
    packing: bool = False
    # Tokens per packed train micro-batch (one packed row) with trainer.packing: samples are
    # placed first-fit by decreasing length. None: trainer.max_seq_len (the longest sample fits
    # alone). At least trainer.max_seq_len.
    micro_batch_tokens: Optional[int] = None

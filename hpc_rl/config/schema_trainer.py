"""The student's optimizer and learning-rate schedule (`trainer.optimizer`, `trainer.scheduler`)
and the trainer's memory keys (`trainer.logprob_*`, `trainer.activation_checkpointing`,
`trainer.cpu_offload`, `trainer.megatron.*`), beside schema.py.

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


# megatron-core's selective recompute modules this mapping passes on (TransformerConfig.recompute_modules);
# mla_up_proj is left out: no architecture the megatron backend loads has multi-latent attention
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts")


@dataclass
class MegatronMemoryConfig(Traced):
    """hpc_rl/models/megatron/memory.py maps these onto megatron-core's TransformerConfig and
    OptimizerConfig. The fsdp2 backend refuses them: its keys are trainer.activation_checkpointing and
    trainer.cpu_offload."""

    # Activation recompute: none keeps every activation; full recomputes whole transformer layers in the
    # backward (set recompute_method and recompute_num_layers); selective recomputes parts of each layer
    # (recompute_modules). trainer.activation_checkpointing=true is the same as full, uniform, 1 layer.
    # Nemotron-H's MambaStack has no full recompute in megatron-core 0.16: refused there.
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    # With full: uniform recomputes the layers of each pipeline stage in groups of recompute_num_layers
    # (which must divide the stage's layers); block recomputes the first recompute_num_layers layers of
    # each stage and keeps the rest's activations. Unset otherwise.
    recompute_method: Optional[Literal["uniform", "block"]] = None
    # With full: layers per recompute group (uniform) or recomputed layers per pipeline stage (block),
    # 1 to the layers of a stage. Unset otherwise (megatron-core requires it unset with selective).
    recompute_num_layers: Optional[int] = None
    # With selective: the parts of each layer recomputed, of core_attn, mlp, moe, moe_act, layernorm,
    # shared_experts (moe_act needs Transformer Engine's grouped GEMM; moe and moe_act need an MoE model,
    # shared_experts one with shared experts, mlp dense MLP layers). None: megatron-core's default,
    # core_attn. Unset otherwise.
    recompute_modules: Optional[List[str]] = None
    # Megatron-core's hybrid optimizer: the distributed optimizer's fp32 main weights, Adam moments and
    # step for optimizer_offload_fraction of the parameters live in host memory and step on the CPU
    # (HybridDeviceOptimizer, with the precision-aware optimizer so that no fp32 main weights stay on
    # the GPU); gradients go to the host and updated weights come back every step. AdamW only
    # (trainer.optimizer.name=adamw).
    optimizer_cpu_offload: bool = False
    # The share of the optimizer's parameters (by element count) offloaded, in (0, 1]. Only with
    # optimizer_cpu_offload.
    optimizer_offload_fraction: float = 1.0


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
    # forward of compute per train step. The student only (teachers never run a backward). On the
    # megatron backend it is megatron-core's full recompute of every layer (trainer.megatron:
    # recompute_granularity=full, recompute_method=uniform, recompute_num_layers=1).
    activation_checkpointing: bool = False
    # Sequence packing: several samples share one row, each with its own position ids; attention
    # never crosses samples (a block-diagonal mask built from the position ids; variable-length
    # flash attention with trainer.attn_implementation=flash_attention_2 on GPU clusters) and
    # Nemotron-H's Mamba state restarts at every sample (hpc_rl/models/packing.py). Train
    # micro-batches are then formed by trainer.micro_batch_tokens (not micro_batch_size rows) and
    # the no-grad log-prob pass packs rows of up to logprob_batch_tokens tokens; the loss is the
    # unpacked loss. The student and the teachers on fsdp2, without context parallel.
    packing: bool = False
    # Tokens per packed train micro-batch (one packed row) with trainer.packing: samples are
    # placed first-fit by decreasing length. None: trainer.max_seq_len (the longest sample fits
    # alone). At least trainer.max_seq_len.
    micro_batch_tokens: Optional[int] = None
    # transformers' attention kernel for the student and the teachers on fsdp2: sdpa | eager |
    # flash_attention_2 (None: transformers' default for the model, sdpa where it has one).
    # flash_attention_2 runs packed rows as variable-length attention (no block-diagonal mask:
    # each sample's attention costs its own length squared); it needs the flash-attn package on
    # the GPU nodes, a 16-bit compute precision and a GPU cluster.
    attn_implementation: Optional[str] = None
    # Leave out of the train step the rows that train nothing: under GRPO a group of equal rewards has
    # advantage 0 on every token (and the overlong filter may leave a row no trained token), so its
    # loss and gradient are exactly 0. The loss's denominator still counts them, so the step's loss
    # and gradients are the same; the forward and backward of those rows are saved. Not applied
    # (the step's metrics say why) with MOPD, a reference KL term in the loss, or
    # algo.mismatch.seq_logprob_error_threshold on the training forward's old log-probs
    # (hpc_rl/roles/zero_advantage.py). false: every row is trained.
    skip_zero_advantage: bool = True
    # FSDP2 CPU offload (torch's CPUOffloadPolicy): each rank's shards of the parameters, their gradients
    # and the optimizer state live in host memory; a layer's shards go to the device for its all-gather,
    # gradients come back after the reduce-scatter, and the optimizer steps on the CPU. Less device memory,
    # a host copy of every layer per forward and backward. The student on fsdp2 over 2+ ranks (dp x cp),
    # without tensor or expert parallel; the megatron backend's is trainer.megatron.optimizer_cpu_offload.
    cpu_offload: bool = False
    # megatron-core's activation recompute and optimizer offload for the student (trainer.backend=megatron).
    megatron: MegatronMemoryConfig = field(default_factory=MegatronMemoryConfig)

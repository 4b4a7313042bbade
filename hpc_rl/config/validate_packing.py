"""Validation of sequence packing (`trainer.packing`, `trainer.micro_batch_tokens`; the fsdp2
backend's models/packing.py) and of the attention kernel that runs packed rows
(`trainer.attn_implementation`), beside validate.py: what the packed forward cannot honour is
refused here, before anything is submitted."""

from __future__ import annotations

from typing import List

from .errors import Violation, check_positive
from .resources import gpus_per_node, teacher_groups


def check_packing(out: List[Violation], cfg) -> None:
    t = cfg.trainer
    if t.micro_batch_tokens is not None and not t.packing:
        out.append(Violation("trainer.micro_batch_tokens", t.micro_batch_tokens,
                             "it sizes packed micro-batches; without trainer.packing the train step forms micro-batches "
                             "of trainer.micro_batch_size rows and would ignore it",
                             "set trainer.packing=true, or remove trainer.micro_batch_tokens"))
    if not t.packing:
        return
    if t.backend != "fsdp2":
        out.append(Violation("trainer.packing", True,
                             f"trainer.backend={t.backend} does not pack: megatron-core's packed (THD) format needs "
                             "Transformer Engine's variable-length attention kernels, not wired in this version",
                             "set trainer.packing=false with trainer.backend=megatron, or use trainer.backend=fsdp2"))
    if t.micro_batch_tokens is not None:
        check_positive(out, "trainer.micro_batch_tokens", t.micro_batch_tokens)
        if 0 < t.micro_batch_tokens < t.max_seq_len:
            out.append(Violation("trainer.micro_batch_tokens", t.micro_batch_tokens,
                                 f"a packed micro-batch must hold the longest sample (trainer.max_seq_len={t.max_seq_len})",
                                 f"set trainer.micro_batch_tokens >= {t.max_seq_len}, or leave it unset (= max_seq_len)"))
    if t.micro_batch_size != 1:
        out.append(Violation("trainer.micro_batch_size", t.micro_batch_size,
                             "with trainer.packing the train step's micro-batches are formed by trainer.micro_batch_tokens "
                             "(tokens, not rows); a row count would be ignored",
                             "remove trainer.micro_batch_size (leave it at 1) and size micro-batches with "
                             "trainer.micro_batch_tokens, or set trainer.packing=false"))
    # the packed forward runs on whole rows of one rank: context parallel would cut a packed row
    # over ranks (ring attention has no per-sample masks here) and tensor parallel's
    # sequence-parallel regions split it (not checked against packed rows yet)
    sections = [("trainer", t.parallel)] + [(g.key, g.config.parallel) for g in teacher_groups(cfg)]
    for key, par in sections:
        for dim in ("cp", "tp"):
            size = getattr(par, dim)
            if size > 1:
                out.append(Violation(f"{key}.parallel.{dim}", size,
                                     f"trainer.packing packs the student's and the teachers' rows; the packed forward runs "
                                     f"without {'context' if dim == 'cp' else 'tensor'} parallel in this version "
                                     "(a packed row's sample boundaries are not carried across its ranks)",
                                     f"set {key}.parallel.{dim}=1, or trainer.packing=false"))


# transformers' names; flash_attention_2 is the variable-length kernel for packed rows on GPUs
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


def check_attention(out: List[Violation], cfg) -> None:
    t = cfg.trainer
    impl = t.attn_implementation
    if impl is None:
        return
    if impl not in ATTN_IMPLEMENTATIONS:
        out.append(Violation("trainer.attn_implementation", impl, f"not one of {list(ATTN_IMPLEMENTATIONS)}",
                             "set trainer.attn_implementation to sdpa, eager or flash_attention_2, or remove it "
                             "(transformers' default)"))
        return
    if t.backend != "fsdp2":
        out.append(Violation("trainer.attn_implementation", impl,
                             f"trainer.backend={t.backend} runs megatron-core's own attention; the key chooses "
                             "transformers' kernel on fsdp2", "remove trainer.attn_implementation with megatron"))
    if impl != "flash_attention_2":
        return
    if gpus_per_node(t, cfg.cluster) == 0:
        out.append(Violation("trainer.attn_implementation", impl,
                             "flash-attn's kernels are CUDA-only; the trainer has no GPUs here (cluster.gpus_per_node=0)",
                             "remove trainer.attn_implementation (sdpa with a block-diagonal mask runs packed rows on CPU)"))
    # flash-attn takes fp16/bf16 inputs only: the compute precision of every model that runs it
    for key, precision in [("trainer.precision", t.precision)] + [
            (f"{g.key}.precision", g.config.precision) for g in teacher_groups(cfg) if g.config.precision]:
        if precision == "fp32":
            out.append(Violation(key, precision,
                                 "trainer.attn_implementation=flash_attention_2 computes in fp16/bf16 only (flash-attn "
                                 "has no fp32 kernel)",
                                 f"set {key}=bf16, or trainer.attn_implementation=sdpa"))

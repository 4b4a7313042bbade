"""The refit group of trainer ranks and vLLM engines (`refit_setup`): which refit rank holds which
boxes of which weight, from the trainer's source layout and the engines' tensor/expert-parallel
layout (vllm_layout.py), and where each engine's ranks start (`engine_first_rank`)."""

from __future__ import annotations


def refit_setup(specs, n_trainers: int, n_engines: int, prefix: str, timeout_s: float = 120.0,
                domain_of=None, bucket_bytes: int = 64 << 20, transport: str = "torch", engine_tp: int = 1,
                src=None, engine_ep: bool = False, hf_config=None):
    """The refit group of `n_trainers` trainer ranks (refit ranks 0..n-1 holding the boxes of
    `src`, the backend's source layout; None: FSDP2's Shard(0) of every weight) and
    `n_engines` vLLM engines of tensor parallel `engine_tp` (engine g's workers are refit
    ranks n + g*engine_tp + their TP rank, each keeping its TP slices; with `engine_ep`,
    vLLM's enable_expert_parallel, each worker keeps whole experts instead of expert
    slices). The first rank of engine g is `engine_first_rank(n_trainers, g, engine_tp)`.
    `hf_config`: the checkpoint's config.json (vllm_layout.vllm_tp_layout)."""
    from .layout import fsdp2, merge
    from .session import RefitSetup
    from .vllm_layout import vllm_tp_layout

    if src is None:
        src = fsdp2(specs, list(range(n_trainers)))
    elif src.ranks() != list(range(n_trainers)):
        raise ValueError(f"the source layout's ranks {src.ranks()} are not the {n_trainers} trainer ranks")
    engines = [[engine_first_rank(n_trainers, g, engine_tp) + j for j in range(engine_tp)] for g in range(n_engines)]
    dst = merge(*[vllm_tp_layout(specs, ranks, expert_parallel=engine_ep, hf_config=hf_config) for ranks in engines])
    names = {i: f"trainer:{i}" for i in range(n_trainers)}
    for g, ranks in enumerate(engines):
        names.update({r: f"generator:{g}" + (f"/tp{j}" if engine_tp > 1 else "") for j, r in enumerate(ranks)})
    return RefitSetup(src=src.to_dict(), dst=dst.to_dict(), proc_of={r: r for r in names}, names=names, prefix=prefix,
                      domain_of=domain_of, bucket_bytes=bucket_bytes, timeout_s=timeout_s, transport=transport)


def engine_first_rank(n_trainers: int, engine: int, engine_tp: int = 1) -> int:
    return n_trainers + engine * engine_tp

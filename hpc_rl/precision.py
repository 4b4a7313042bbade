"""The precision names of the config (`fp32`, `bf16`, `fp16`) and what each means to torch
and to vLLM: the one map every role, the refit and the checkpoint export use."""

from __future__ import annotations

from typing import Dict

PRECISIONS = ("fp32", "bf16", "fp16")

# vLLM's `dtype=` strings; torch's attribute names are the same words
_VLLM: Dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def vllm_dtype(precision: str) -> str:
    """`bf16` -> "bfloat16" (vLLM's dtype argument, also torch's attribute name)."""
    if precision not in _VLLM:
        raise ValueError(f"precision {precision!r}: expected one of {list(PRECISIONS)}")
    return _VLLM[precision]


def torch_dtype(precision: str):
    """`bf16` -> torch.bfloat16 (imported lazily: the launcher side does not need torch)."""
    import torch

    return getattr(torch, vllm_dtype(precision))

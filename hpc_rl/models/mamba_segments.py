"""Mamba state resets at sample boundaries of a packed row.

Why: attention learns where a packed sample starts from the position ids (models/packing.py),
but a Mamba-2 mixer is a recurrence over the whole row: its convolution and its SSM state
would carry the end of one sample into the start of the next, and the packed log-probs would
no longer be the unpacked ones. transformers' torch path of the mixer has no sequence index
(its `seq_idx` keyword is accepted and ignored), so here every mixer runs once per sample
span: each span starts from a zero state and a zero convolution window, exactly like an
unpacked row. On GPUs with the mamba-ssm and causal-conv1d kernels installed, the spans go in
as the kernels' own `seq_idx` instead (one call; the kernels restart the state where it
changes), which tests/gpu/packing_check.sh checks against the unpacked forward.

A mixer is recognised by what it holds (A_log, dt_bias, conv1d: the Mamba-2 parameters), not
by a class name, and wrapped once per model when packing is on. The spans of the forward in
flight live on a holder the model's wrapped mixers share, set by the packed forward
(`segments(model, ...)`) for its forward and backward alike: with activation checkpointing the
backward runs the mixers again (on GPUs in autograd's own thread, where a context variable
of the caller would not be seen). Outside it the mixers run as before.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import List, Optional, Sequence, Tuple

import torch

Spans = List[Sequence[Tuple[int, int]]]  # per packed row, its samples' [start, end) spans


class _Holder:
    """The spans of the packed forward (and backward) in flight; None: not packed."""

    def __init__(self):
        self.spans: Optional[Spans] = None


def is_mamba_mixer(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("A_log", "dt_bias", "conv1d"))


def kernels_take_seq_idx() -> bool:
    """mamba-ssm's scan and causal-conv1d's convolution both read `seq_idx` (GPU only)."""
    return (torch.cuda.is_available() and importlib.util.find_spec("mamba_ssm") is not None
            and importlib.util.find_spec("causal_conv1d") is not None)


@contextlib.contextmanager
def segments(model: torch.nn.Module, spans_per_row: Spans):
    """The packed rows' sample spans while the block runs (a forward, and its backward
    where activation checkpointing recomputes the mixers). A model without mixers: nothing."""
    holder = getattr(model, "_hpc_rl_spans", None)
    if holder is None:
        yield
        return
    holder.spans = spans_per_row
    try:
        yield
    finally:
        holder.spans = None


def seq_idx_of(spans_per_row: List[Sequence[Tuple[int, int]]], length: int, device) -> torch.Tensor:
    """[rows, length] int32: the index of the sample each token belongs to."""
    out = torch.zeros((len(spans_per_row), length), dtype=torch.int32)
    for r, spans in enumerate(spans_per_row):
        for k, (s, e) in enumerate(spans):
            out[r, s:e] = k
    return out.to(device)


def _segmented(forward, holder: _Holder, use_seq_idx: bool):
    @functools.wraps(forward)
    def run(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        spans = holder.spans
        if spans is None or cache_params is not None:  # not packed (or decoding with a cache)
            return forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
        if use_seq_idx and hidden_states.is_cuda:
            idx = seq_idx_of(spans, hidden_states.shape[1], hidden_states.device)
            return forward(hidden_states, cache_params=None, attention_mask=None, seq_idx=idx, **kwargs)
        rows = []
        for r, row_spans in enumerate(spans):
            parts = [forward(hidden_states[r:r + 1, s:e], cache_params=None, attention_mask=None, **kwargs)
                     for s, e in row_spans]
            rows.append(torch.cat(parts, 1))
        return torch.cat(rows, 0)

    run.hpc_rl_segmented = True
    return run


def install(model: torch.nn.Module, use_seq_idx: Optional[bool] = None) -> int:
    """Wrap every Mamba mixer of `model` (idempotent); returns how many there are."""
    use = kernels_take_seq_idx() if use_seq_idx is None else use_seq_idx
    holder = model.__dict__.get("_hpc_rl_spans") or _Holder()
    count = 0
    for module in model.modules():
        if is_mamba_mixer(module):
            if not getattr(module.forward, "hpc_rl_segmented", False):
                module.forward = _segmented(module.forward, holder, use)
            count += 1
    if count:
        model.__dict__["_hpc_rl_spans"] = holder  # not a submodule or parameter: state dicts stay
    return count

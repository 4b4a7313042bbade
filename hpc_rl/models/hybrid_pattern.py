"""A hybrid (Nemotron-H) checkpoint's layer pattern, one letter per layer, from either of its
config keys: `hybrid_override_pattern` ("M*M-E...") or `layers_block_type` (["mamba", ...]).
One reading serves the Megatron mapping (models/megatron/nemotron_h_mapping.py) and the plan's
memory model (hpc_rl/memory/shape.py), each raising its own error type with the message."""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

BLOCK_LETTERS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                 "moe": "E"}
MIXERS = "*-EM"  # attention, dense MLP, MoE, Mamba-2


def read_pattern(cfg: Mapping) -> Tuple[str, Optional[Tuple[str, str]]]:
    """(pattern, None) or (what was read, (the config key at fault, the problem))."""
    if cfg.get("hybrid_override_pattern"):
        pattern = str(cfg["hybrid_override_pattern"])
    else:
        types = cfg.get("layers_block_type") or []
        unknown = sorted({t for t in types if t not in BLOCK_LETTERS})
        if unknown:
            return "", ("layers_block_type", f"layers_block_type {unknown}: known are {sorted(BLOCK_LETTERS)}")
        pattern = "".join(BLOCK_LETTERS[t] for t in types)
    if not pattern or set(pattern) - set(MIXERS):
        return pattern, ("hybrid_override_pattern",
                         f"layer pattern {pattern!r}: one of M, *, -, E per layer")
    return pattern, None

"""Phi-3 in a vLLM engine of tensor parallel tp, in Hugging Face names.

Hugging Face already fuses what vLLM fuses: `self_attn.qkv_proj` ([q; k; v] rows: heads*d,
kv_heads*d, kv_heads*d) and `mlp.gate_up_proj` ([gate; up], I rows each). vLLM's Phi-3
(models/phi3.py) is its Llama with packed_modules_mapping {qkv_proj: [qkv_proj],
gate_up_proj: [gate_up_proj]}: the names are the same, and its QKVParallelLinear /
MergedColumnParallelLinear loaders, given the whole fused tensor (no shard id), cut it into
its members and take rank r's rows of each. So rank r holds [q_r; k_r; v_r] and [gate_r; up_r]:
three (two) boxes of the HF tensor, never one contiguous chunk (a plain split at tp 2 would
hand rank 0 all of q and nothing of v). The receiver hands the loader those boxes
(refit/presharded.py): its narrow to one member contains whole boxes, its narrow to the rank's
rows of it is one box.
"""

from __future__ import annotations

import re
from typing import List, Mapping, Optional, Sequence, Tuple

from hpc_rl.refit.layout import LayoutError, Piece

Specs = Mapping[str, Tuple[Sequence[int], str]]

_FUSED = re.compile(r"^(?P<layer>.*)\.(?P<kind>self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$")


def owns(name: str) -> bool:
    """The HF-fused tensors: no other family's checkpoint names a qkv_proj or gate_up_proj."""
    return _FUSED.match(name) is not None


def vllm_name(name: str) -> str:
    return name  # vLLM's parameters carry the same names


def fused_member(name: str) -> Optional[str]:
    return None  # not a member: the whole fused parameter, cut by vLLM's loader itself


def member_rows(name: str, shape: Sequence[int], specs: Specs) -> Optional[List[int]]:
    """Rows of each member of a fused tensor: q, k, v (the q width is o_proj's input) or gate, up."""
    m = _FUSED.match(name)
    if not m:
        return None
    rows = shape[0]
    if m.group("kind") == "mlp.gate_up_proj":
        return [rows // 2, rows // 2]
    q = specs[f"{m.group('layer')}.self_attn.o_proj.weight"][0][1]
    return [q, (rows - q) // 2, (rows - q) // 2]


def pieces(name: str, shape: Sequence[int], specs: Specs, ranks: Sequence[int],
           hf_config: Optional[Mapping] = None) -> Optional[List[Piece]]:
    """The boxes each TP rank of vLLM keeps of a fused tensor (None: not one of Phi-3's own)."""
    sizes = member_rows(name, shape, specs)
    if sizes is None:
        return None
    tp, cols = len(ranks), tuple(shape[1:])
    if any(s % tp for s in sizes):
        raise LayoutError(f"{name}: members of {sizes} rows do not split over tensor parallel {tp} (vLLM splits "
                          f"q, k and v (gate and up) each evenly)")
    out: List[Piece] = []
    for r, rank in enumerate(ranks):
        offset, rows = 0, []
        for size in sizes:
            a, b = offset + r * (size // tp), offset + (r + 1) * (size // tp)
            if rows and rows[-1][1] == a:  # adjacent boxes (tp 1): one box, as the planner expects
                rows[-1] = (rows[-1][0], b)
            else:
                rows.append((a, b))
            offset += size
        out += [Piece(rank, (a,) + (0,) * len(cols), (b,) + cols) for a, b in rows]
    return out


def local_shape(name: str, shape: Sequence[int], specs: Specs, tp: int,
                hf_config: Optional[Mapping] = None) -> Optional[Tuple[int, ...]]:
    """vLLM's parameter on one TP rank: every member's rows / tp."""
    sizes = member_rows(name, shape, specs)
    return None if sizes is None else (sum(s // tp for s in sizes),) + tuple(shape[1:])

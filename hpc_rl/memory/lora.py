"""LoRA's adapter parameters from a model's shape (trainer.lora), pure arithmetic like the rest
of memory/: an adapted linear W [out, in] adds A [r, in] and B [out, r], r * (in + out) parameters.

Names follow HF's: attention's q/k/v/o_proj on every attention mixer (`*`), the MLP's gate/up/down_proj
on every dense MLP mixer (`-`, no gate when not gated). Fused routed experts are not nn.Linear
modules (peft cannot adapt them) and Mamba mixers' projections are not in the default tables:
other names count nothing here.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

from .shape import Shape


def _linears(s: Shape) -> Dict[str, Tuple[str, int, int]]:
    """name -> (the mixer holding it, in, out)."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = {"q_proj": ("*", h, q), "k_proj": ("*", h, kv), "v_proj": ("*", h, kv), "o_proj": ("*", q, h),
           "up_proj": ("-", h, s.ffn), "down_proj": ("-", s.ffn, h)}
    if s.gated:
        out["gate_proj"] = ("-", h, s.ffn)
    return out


def adapter_params(s: Shape, rank: int, targets: Sequence[str]) -> int:
    """Every adapter parameter of the model (A and B of each adapted linear, every layer)."""
    total = 0
    for name in targets:
        if name in _linears(s):
            mixer, n_in, n_out = _linears(s)[name]
            total += s.count(mixer) * rank * (n_in + n_out)
    return total

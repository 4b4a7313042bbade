"""Which linear modules get LoRA adapters by default, per model family (trainer.lora.target_modules
unset), keyed by the checkpoint's config.json model_type.

Pure data (no torch): config validation and the fsdp2 backend both read it. A family moves into
hpc_rl/models/families/ with the rest of its description when that folder holds it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GATED_MLP = ("gate_proj", "up_proj", "down_proj")

# Every projection of attention and MLP for the dense families; for Qwen3-MoE attention only, since
# transformers 5 holds its experts fused as 3-D parameters (mlp.experts.gate_up_proj), which are not
# nn.Linear modules peft can wrap. vLLM's LoRA layers cover the same names (qkv_proj / gate_up_proj
# stacked from them).
DEFAULT_TARGETS: Dict[str, Tuple[str, ...]] = {
    "llama": ATTENTION + GATED_MLP,
    "qwen2": ATTENTION + GATED_MLP,
    "qwen3": ATTENTION + GATED_MLP,
    "qwen3_moe": ATTENTION,
}


def default_targets(model_type: str) -> Optional[List[str]]:
    """The family's default target modules, or None when it has none (set them explicitly)."""
    t = DEFAULT_TARGETS.get(model_type)
    return list(t) if t is not None else None

"""What differs between MoE families for expert parallel and per-expert checkpoint names.

One dispatch path (expert_parallel.py) and one name translation (expert_names.py) serve every
family listed here; a family is data: which Hugging Face block holds the experts, which 3-D
parameters the experts module keeps (expert dimension first, [E, out, in] as for F.linear),
how one expert's MLP runs on its rows, and which per-expert tensor each fused one becomes in
checkpoints and vLLM's loaders.

- Qwen3-MoE (transformers 5, in memory): `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows then
  up rows) and `mlp.experts.down_proj` [E, H, I]; a gated SiLU MLP. Checkpoint names
  `mlp.experts.<e>.gate_proj.weight` [I, H], `up_proj.weight` [I, H], `down_proj.weight` [H, I].
- Nemotron-H (NemotronHMoE): `mixer.experts.up_proj` [E, I, L] and `mixer.experts.down_proj`
  [E, L, I], non-gated relu2, where L is `moe_latent_size` (the experts work between the
  block's `fc1_latent_proj` and `fc2_latent_proj`) or the hidden size without a latent MoE.
  Checkpoint names `mixer.experts.<e>.up_proj.weight` [I, L] and `down_proj.weight` [L, I]
  (what save_pretrained writes and vLLM's Nemotron-H loader reads as its w1/w2 of the
  fused MoE). The router (`mixer.gate`: weight and the fp32 buffer `e_score_correction_bias`),
  the shared expert and both latent projections are not experts: they stay replicated
  (FSDP2-sharded like any dense weight) and keep their own names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Tuple

import torch
import torch.nn.functional as F

# fused parameter -> its per-expert tensors: (checkpoint suffix, part, parts) = rows
# [part*R/parts, (part+1)*R/parts) of the expert's [R, C] slice
Members = Mapping[str, Tuple[Tuple[str, int, int], ...]]


@dataclass(frozen=True)
class ExpertFamily:
    name: str
    blocks: Tuple[str, ...]  # HF MoE block classes whose `experts` submodule is replaced
    members: Members  # the experts module's 3-D parameters, in order, and their checkpoint tensors
    mlp: Callable[[torch.Tensor, Dict[str, torch.Tensor], Callable], torch.Tensor]  # (rows, one expert's weights, act)

    @property
    def fused(self) -> Tuple[str, ...]:
        return tuple(self.members)


def _gated(x: torch.Tensor, w: Dict[str, torch.Tensor], act: Callable) -> torch.Tensor:
    gate, up = F.linear(x, w["gate_up_proj"]).chunk(2, dim=-1)  # HF's order: gate rows, then up rows
    return F.linear(act(gate) * up, w["down_proj"])


def _plain(x: torch.Tensor, w: Dict[str, torch.Tensor], act: Callable) -> torch.Tensor:
    return F.linear(act(F.linear(x, w["up_proj"])), w["down_proj"])


FAMILIES: Tuple[ExpertFamily, ...] = (
    ExpertFamily("qwen3_moe", ("Qwen3MoeSparseMoeBlock",),
                 {"gate_up_proj": (("gate_proj.weight", 0, 2), ("up_proj.weight", 1, 2)),
                  "down_proj": (("down_proj.weight", 0, 1),)}, _gated),
    ExpertFamily("nemotron_h", ("NemotronHMoE",),
                 {"up_proj": (("up_proj.weight", 0, 1),), "down_proj": (("down_proj.weight", 0, 1),)}, _plain),
)


def _all_members() -> Dict[str, Tuple[Tuple[str, int, int], ...]]:
    """Fused name -> members over every family. The checkpoint translation reads names only,
    so two families may share a fused name only if they split it the same way."""
    out: Dict[str, Tuple[Tuple[str, int, int], ...]] = {}
    for fam in FAMILIES:
        for name, members in fam.members.items():
            if out.setdefault(name, members) != members:
                raise AssertionError(f"experts.{name} splits differently in {fam.name} and another family")
    return out


MEMBERS = _all_members()


def family_of_block(block: torch.nn.Module):
    """The family whose MoE block this module is, or None."""
    kind = type(block).__name__
    return next((f for f in FAMILIES if kind in f.blocks), None)


def block_names() -> Tuple[str, ...]:
    return tuple(b for f in FAMILIES for b in f.blocks)

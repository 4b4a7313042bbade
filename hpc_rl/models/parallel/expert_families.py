"""What differs between MoE families for expert parallel and per-expert checkpoint names.

One dispatch path (expert_parallel.py) and one name translation (expert_names.py) serve every
MoE family of the registry (hpc_rl/models/families/: each MoE family's `ExpertLayout` says
which Hugging Face block holds the experts, which 3-D parameters the experts module keeps
(expert dimension first, [E, out, in] as for F.linear) and which per-expert tensor each fused
one becomes in checkpoints and vLLM's loaders). This module adds how one expert's MLP runs on
its rows: `gated` (act(gate) * up, one fused gate_up_proj with gate rows first, as HF keeps it)
or `plain` (act(up), no gate: non-gated relu2 experts). The router, shared experts and latent
projections are not experts: they stay replicated (FSDP2-sharded like any dense weight) and
keep their own names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F

from hpc_rl.models import families
from hpc_rl.models.families.spec import Members


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


_MLPS = {"gated": _gated, "plain": _plain}

FAMILIES: Tuple[ExpertFamily, ...] = tuple(
    ExpertFamily(f.name, f.experts.blocks, f.experts.members, _MLPS[f.experts.mlp])
    for f in families.FAMILIES if f.experts is not None)


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

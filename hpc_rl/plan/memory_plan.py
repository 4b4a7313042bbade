"""Each role's memory per GPU as the plan records it (plan.json "memory"; the dry run's table,
plan/memory_report.py). The figures are hpc_rl/memory/'s, from config/memory_inputs.py's inputs;
config/memory_fit.py refuses, for launches, a role that does not fit."""

from __future__ import annotations

from typing import Dict, Optional

from hpc_rl.config.memory_inputs import RoleInput, role_inputs, usable_bytes
from hpc_rl.config.schema import RunConfig
from hpc_rl.memory.model import RoleMemory, budget, role_memory


def role_figures(item: RoleInput, usable: Optional[int]) -> Optional[dict]:
    """One role's entry (bytes), or None without a shape."""
    if item.shape is None:
        return None
    m: RoleMemory = role_memory(item.shape, item.setup)
    limit = budget(item.setup, usable)
    doc = {"shape": item.source, "phase": m.phase, "parts": dict(m.parts), "peak": m.peak, "required": m.required,
           "budget": limit, "fits": None if limit is None else m.required <= limit}
    if item.setup.kind == "trainer":
        doc.update(activations_full=m.activations_full, activations_recompute=m.activations_recompute,
                   recompute=item.setup.recompute, offload=item.setup.offload)
    if item.setup.kind == "generator" and limit is not None:
        doc.update(kv_tokens=m.kv_tokens, kv_minimum=m.kv_minimum)
    if m.notes:
        doc["notes"] = list(m.notes)
    return doc


def memory_doc(cfg: RunConfig) -> dict:
    """plan.json's "memory": the GPU's memory and, per role, its parts at the peak (bytes)."""
    usable = usable_bytes(cfg)
    roles: Dict[str, dict] = {}
    missing: Dict[str, str] = {}
    for item in role_inputs(cfg):
        figures = role_figures(item, usable)
        if figures is None:
            missing[item.role] = item.source
        else:
            roles[item.role] = figures
    return {"gpu_memory_gib": cfg.cluster.gpu_memory_gib, "headroom": cfg.cluster.gpu_memory_headroom,
            "usable": usable, "roles": roles, **({"unknown": missing} if missing else {})}

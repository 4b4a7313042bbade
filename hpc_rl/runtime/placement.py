"""Placement at rendezvous: every rank reports its node's topology facts, then every rank
computes the same placement (hpc_rl.plan.placement) and takes its placed rank before any
process group exists. The store host stays Slurm's first trainer task; only ranks move."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, Optional, Tuple

from hpc_rl.config.schema import RunConfig
from hpc_rl.plan.job_plan import JobPlan
from hpc_rl.plan.placement import JobPlacement, PlacementError, place_job
from hpc_rl.plan.topology import DiscoveryInputs, NodeFacts, discover, parse_cluster_uuid
from hpc_rl.durable import write_atomic
from hpc_rl.rundir import RunDir

from .identity import RankIdentity, role_offsets


def fabric_uuid() -> Optional[str]:
    """This node's NVLink fabric ClusterUUID, when nvidia-smi reports one (GB200)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_cluster_uuid(out)


def node_facts() -> dict:
    return {"topology_addr": os.environ.get("SLURM_TOPOLOGY_ADDR") or None, "cluster_uuid": fabric_uuid()}


def compute_placement(cfg: RunConfig, plan: JobPlan, announced: Dict[int, dict], run_dir: Path,
                      restart: int) -> Tuple[JobPlacement, Dict[int, int]]:
    """(placement, provisional global rank -> placed global rank)."""
    offsets = role_offsets(plan)
    by_role: Dict[str, list] = {}
    for g in sorted(announced):
        by_role.setdefault(announced[g]["role"], []).append(announced[g])
    allocated = {role: list(dict.fromkeys(a["node"] for a in sorted(rows, key=lambda a: a["role_rank"])))
                 for role, rows in by_role.items()}
    facts = {a["node"]: NodeFacts(a.get("topology_addr"), a.get("cluster_uuid")) for a in announced.values()}
    topo_file = RunDir(run_dir).topology(restart)
    inputs = DiscoveryInputs(
        nodes=[a["node"] for _, a in sorted(announced.items())],
        facts=facts,
        scontrol_text=topo_file.read_text() if topo_file.exists() else None,
        explicit=cfg.cluster.domains,
        host_pattern=cfg.cluster.domain_pattern,
    )
    dmap = discover(inputs, allow_hostname=not cfg.cluster.require_topology or bool(cfg.cluster.domain_pattern))
    placement = place_job(plan, allocated, dmap, required=cfg.cluster.require_topology)
    mapping: Dict[int, int] = {}
    for g, a in announced.items():
        role = plan.role(a["role"])
        first, _ = offsets[role.name]
        rp = placement.roles.get(role.name)
        if rp is None:
            mapping[g] = g
            continue
        if a["node"] in rp.spares:
            raise PlacementError(f"{role.name}:{a['role_rank']} runs on {a['node']}, a node outside every complete "
                                 f"segment (spares: {rp.spares}); the job must not start tasks on spare nodes")
        mapping[g] = first + rp.node_index(a["node"]) * role.tasks_per_node + a["local_rank"]
    if sorted(mapping.values()) != sorted(mapping):
        raise PlacementError(f"placement produced a rank map that is not a permutation: {mapping}")
    return placement, mapping


def placed_identity(ident: RankIdentity, mapping: Dict[int, int], plan: JobPlan) -> RankIdentity:
    g = mapping[ident.global_rank]
    first, _ = role_offsets(plan)[ident.role]
    return dataclasses.replace(ident, global_rank=g, role_rank=g - first)


def write_report(run_dir: Path, restart: int, placement: JobPlacement) -> Path:
    path = RunDir(run_dir).placement(restart)
    write_atomic(path, json.dumps(placement.to_dict(), indent=2) + "\n")
    return path

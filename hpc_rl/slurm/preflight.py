"""Checks against the live cluster before anything is submitted: sbatch exists, the
partition exists, and every role fits in it. Failures are config violations (exit 2)."""

from __future__ import annotations

import shutil
import subprocess
from typing import Dict, List, Optional, Tuple

from hpc_rl.config.errors import ConfigError, Violation
from hpc_rl.config.schema import RunConfig
from hpc_rl.plan.job_plan import JobPlan, role_config_key


def partitions() -> Tuple[Dict[str, int], Optional[str]]:
    """partition -> node count, and the default partition (sinfo marks it with '*')."""
    proc = subprocess.run(["sinfo", "-h", "-o", "%P|%D"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise ConfigError([Violation("launcher", "slurm", f"sinfo failed: {proc.stderr.strip() or proc.returncode}",
                                     "check that slurmctld is reachable (make cluster-up for the local cluster)")])
    nodes: Dict[str, int] = {}
    default = None
    for line in proc.stdout.splitlines():
        name, _, count = line.strip().partition("|")
        if name.endswith("*"):
            name = name[:-1]
            default = name
        if name:
            nodes[name] = nodes.get(name, 0) + int(count or 0)
    return nodes, default


def check_slurm(cfg: RunConfig, plan: JobPlan) -> str:
    """Raise ConfigError listing every problem; return the partition the job will use."""
    if shutil.which("sbatch") is None:
        raise ConfigError([Violation("launcher", "slurm", "Slurm's sbatch is not on PATH on this machine",
                                     "use launcher=local to run every role as processes here, or launcher=dry_run to "
                                     "print the plan; on a cluster, run from a login node")])
    nodes, default = partitions()
    out: List[Violation] = []
    part = cfg.cluster.partition or default
    if part is None or part not in nodes:
        out.append(Violation("cluster.partition", cfg.cluster.partition, f"the cluster has no partition {part!r}",
                             f"set cluster.partition to one of {sorted(nodes)}"))
        raise ConfigError(out)
    have = nodes[part]
    for role in plan.roles:
        if role.nodes > have:
            key = role_config_key(role.name)
            out.append(Violation(f"{key}.nodes", role.nodes, f"partition {part!r} has {have} nodes",
                                 f"set {key}.nodes <= {have} or use a larger partition (cluster.partition=...)"))
    need = plan.total_nodes if cfg.cluster.exclusive else max(r.nodes for r in plan.roles)
    if not out and need > have:
        out.append(Violation("cluster.partition", part, f"the job needs {need} nodes and partition {part!r} has {have}",
                             "lower the roles' nodes or use a larger partition"))
    if out:
        raise ConfigError(out)
    return part

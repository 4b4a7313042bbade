"""Placement on synthetic GB200 NVL72 clusters (a fake cluster: no such rack exists here).

Cluster: 16 racks of 18 nodes (one NVLink domain each), 5% of nodes down at random, other
jobs holding a random 0-6 nodes per rack (fragmentation). Node names follow slurm.conf
order, which is Slurm's task order; racks are contiguous name ranges except for nodes
replaced after repairs (10% of names swapped between racks), as on long-lived clusters.

Scenarios for the ultra_mopd plan (224 nodes: trainer 64 in EP segments of 16, generator
128 in TP8 instances of 2, five teacher groups of 4, env 12):
  segment   Slurm 24.05 honours --segment: each segment is allocated inside one rack, and
            the node list comes back in name order.
  spares    no segment support (Slurm < 24.05, tree fabrics): each role asks 1/8 more
            nodes than it uses; Slurm fills whole racks first; the list comes back in name order.
For each: the share of multi-node groups (EP groups, vLLM instances, teacher groups)
inside one domain with our placement and with Slurm's plain rank order, the share of
allocated nodes used, and the time to place. Planning time is also measured for a
1024-node allocation. Writes bench/results/placement.json.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc_rl.config import load_config  # noqa: E402
from hpc_rl.config.resources import ep_span_nodes, instance_span_nodes  # noqa: E402
from hpc_rl.plan import build_plan  # noqa: E402
from hpc_rl.plan.job_plan import JobPlan, RolePlan  # noqa: E402
from hpc_rl.plan.placement import PlacementError, groups_in_one_domain, place_job  # noqa: E402
from hpc_rl.plan.topology import DomainMap  # noqa: E402

RACKS, PER_RACK = 16, 18
TRIALS = 20
DOWN_FRACTION, SWAP_FRACTION, SPARE_FRACTION = 0.05, 0.10, 0.125
BUSY_MAX = 3  # other jobs' nodes per rack, drawn uniformly from 0..BUSY_MAX


def make_cluster(rng: random.Random, racks: int = RACKS):
    names = [f"gb-{i:04d}" for i in range(racks * PER_RACK)]
    rack_of = {n: f"rack{i // PER_RACK:02d}" for i, n in enumerate(names)}
    nodes = list(names)
    for _ in range(int(len(nodes) * SWAP_FRACTION / 2)):  # repaired nodes came back under other names
        a, b = rng.sample(range(len(nodes)), 2)
        rack_of[nodes[a]], rack_of[nodes[b]] = rack_of[nodes[b]], rack_of[nodes[a]]
    down = set(rng.sample(names, int(len(names) * DOWN_FRACTION)))
    busy = set()
    for r in range(racks):
        members = [n for n in names if rack_of[n] == f"rack{r:02d}" and n not in down]
        busy.update(rng.sample(members, min(len(members), rng.randint(0, BUSY_MAX))))
    free = [n for n in names if n not in down and n not in busy]  # in name order
    return free, DomainMap(rack_of, "explicit", "synthetic NVL72 racks")


def group_span(role: RolePlan, plan_cfg) -> int:
    """Nodes per group that must share a domain: trainer EP group, vLLM instance, teacher group."""
    if role.name == "trainer":
        return ep_span_nodes(plan_cfg.trainer, plan_cfg.cluster)
    if role.name == "generator":
        return instance_span_nodes(plan_cfg.generator, plan_cfg.cluster)
    return role.segment_size


def allocate_segments(plan: JobPlan, free: List[str], dmap: DomainMap) -> Optional[Dict[str, List[str]]]:
    """Slurm with --segment: best fit of each segment into one rack; node list in name order."""
    free = list(free)
    out: Dict[str, List[str]] = {}
    for role in plan.roles:
        got: List[str] = []
        for _ in range(role.nodes // role.segment_size):
            by_rack: Dict[str, List[str]] = {}
            for n in free:
                by_rack.setdefault(dmap.of(n), []).append(n)
            fits = [r for r, ns in by_rack.items() if len(ns) >= role.segment_size]
            if not fits:
                return None
            rack = min(fits, key=lambda r: (len(by_rack[r]), r))  # best fit
            take = by_rack[rack][:role.segment_size]
            got += take
            free = [n for n in free if n not in set(take)]
        out[role.name] = sorted(got)
    return out


def allocate_with_spares(plan: JobPlan, free: List[str], dmap: DomainMap) -> Optional[Dict[str, List[str]]]:
    """No segment support (tree --switches): each role asks nodes*(1+spare) and Slurm fills
    whole racks first, emptiest-of-other-jobs first; the node list comes back in name order."""
    free = list(free)
    out: Dict[str, List[str]] = {}
    for role in plan.roles:
        want = role.nodes + (int(role.nodes * SPARE_FRACTION + 0.999) if role.segment_size > 1 else 0)
        if len(free) < want:
            return None
        by_rack: Dict[str, List[str]] = {}
        for n in free:
            by_rack.setdefault(dmap.of(n), []).append(n)
        got: List[str] = []
        for rack in sorted(by_rack, key=lambda r: (-len(by_rack[r]), r)):
            got += by_rack[rack][:want - len(got)]
            if len(got) == want:
                break
        out[role.name] = sorted(got)
        free = [n for n in free if n not in set(got)]
    return out


def evaluate(plan: JobPlan, cfg, alloc: Dict[str, List[str]], dmap: DomainMap) -> dict:
    t0 = time.perf_counter()
    try:
        placement = place_job(plan, alloc, dmap, required=True)
    except PlacementError:
        placement = None
    seconds = time.perf_counter() - t0
    ours_in = ours_total = plain_in = plain_total = 0
    used = sum(r.nodes for r in plan.roles)
    allocated = sum(len(v) for v in alloc.values())
    for role in plan.roles:
        span = group_span(role, cfg)
        if span <= 1:
            continue
        i, t = groups_in_one_domain(alloc[role.name][:role.nodes], span, dmap)  # Slurm's rank order
        plain_in, plain_total = plain_in + i, plain_total + t
        if placement is not None:
            i, t = groups_in_one_domain(placement.roles[role.name].ordered_nodes, span, dmap)
            ours_in, ours_total = ours_in + i, ours_total + t
    return {"placed": placement is not None, "seconds": seconds, "ours_inside": ours_in, "ours_groups": ours_total,
            "plain_inside": plain_in, "plain_groups": plain_total, "used_share": used / allocated}


def scenario(name: str, plan: JobPlan, cfg, allocate) -> dict:
    rows = []
    for seed in range(TRIALS):
        rng = random.Random(seed)
        free, dmap = make_cluster(rng)
        alloc = allocate(plan, free, dmap)
        if alloc is None:
            rows.append({"allocated": False})
            continue
        rows.append({"allocated": True, **evaluate(plan, cfg, alloc, dmap)})
    ok = [r for r in rows if r["allocated"]]
    placed = [r for r in ok if r["placed"]]

    def share(key_in, key_total, subset):
        total = sum(r[key_total] for r in subset)
        return sum(r[key_in] for r in subset) / total if total else None

    return {
        "scenario": name,
        "trials": len(rows),
        "allocated": len(ok),
        "placed": len(placed),
        "groups_inside_one_domain_ours": share("ours_inside", "ours_groups", placed),
        "groups_inside_one_domain_plain_slurm_order": share("plain_inside", "plain_groups", ok),
        "groups_spanning_domains_plain_per_job_mean": statistics.mean(r["plain_groups"] - r["plain_inside"] for r in ok) if ok else None,
        "groups_per_job": ok[0]["plain_groups"] if ok else None,
        "allocated_nodes_used_share_mean": statistics.mean(r["used_share"] for r in placed) if placed else None,
        "placement_seconds_max": max(r["seconds"] for r in ok) if ok else None,
    }


def planning_time_1024() -> dict:
    """Place a 1024-node allocation on 64 racks: trainer 512 (EP segments of 16), generator 448, env 64."""
    rng = random.Random(0)
    racks = 64
    names = [f"gb-{i:04d}" for i in range(racks * PER_RACK)]
    dmap = DomainMap({n: f"rack{i // PER_RACK:02d}" for i, n in enumerate(names)}, "explicit", "synthetic")
    plan = JobPlan("scale", "gb200_nvl72", [
        RolePlan("trainer", 512, 4, 4, {"tp": 8, "cp": 32, "ep": 64, "pp": 1, "dp": 8}, 16),
        RolePlan("generator", 448, 4, 4, {"tp": 8, "cp": 1, "ep": 8, "pp": 1, "dp": 224}, 2),
        RolePlan("env", 64, 0, 1, {"tp": 1, "cp": 1, "ep": 1, "pp": 1, "dp": 64}, 1),
    ])
    alloc = allocate_segments(plan, [n for n in names if rng.random() > 0.02], dmap)
    assert alloc is not None
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        place_job(plan, alloc, dmap, required=True)
        times.append(time.perf_counter() - t0)
    return {"nodes": sum(len(v) for v in alloc.values()), "seconds_median": statistics.median(times), "seconds_max": max(times)}


def main() -> int:
    cfg = load_config(["+recipe=ultra_mopd", "cluster=gb200_nvl72"])
    plan = build_plan(cfg)
    results = [scenario("segment", plan, cfg, allocate_segments), scenario("spares", plan, cfg, allocate_with_spares)]
    doc = {
        "benchmark": "placement",
        "cluster": f"synthetic GB200 NVL72: {RACKS} racks x {PER_RACK} nodes, {DOWN_FRACTION:.0%} down, 0-{BUSY_MAX} busy per rack, "
                   f"{SWAP_FRACTION:.0%} of names swapped between racks",
        "plan": f"ultra_mopd, {plan.total_nodes} nodes",
        "scenarios": results,
        "planning_time_1024_nodes": planning_time_1024(),
    }
    out = ROOT / "bench" / "results" / "placement.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    for r in results:
        print(f"{r['scenario']:>8}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                 for k, v in r.items() if k != "scenario"))
    print(f"planning 1024 nodes: {doc['planning_time_1024_nodes']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

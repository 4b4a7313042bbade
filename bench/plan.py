"""Time to compose, validate and plan the shipped recipes (what every launch pays first).

Writes bench/results/plan.json: median and max seconds over repeats, per recipe and cluster.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc_rl.config import load_config  # noqa: E402
from hpc_rl.plan import build_plan  # noqa: E402

CASES = [("ultra_mopd", "gb200_nvl72"), ("ultra_mopd", "h100")]
REPEATS = 10


def measure(recipe: str, cluster: str) -> dict:
    compose_s, plan_s = [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        cfg = load_config([f"+recipe={recipe}", f"cluster={cluster}"])
        t1 = time.perf_counter()
        plan = build_plan(cfg)
        t2 = time.perf_counter()
        compose_s.append(t1 - t0)
        plan_s.append(t2 - t1)
    return {
        "recipe": recipe,
        "cluster": cluster,
        "total_nodes": plan.total_nodes,
        "roles": len(plan.roles),
        "repeats": REPEATS,
        "compose_validate_s_median": statistics.median(compose_s),
        "compose_validate_s_max": max(compose_s),
        "plan_s_median": statistics.median(plan_s),
        "plan_s_max": max(plan_s),
    }


def main() -> int:
    results = [measure(r, c) for r, c in CASES]
    doc = {"benchmark": "plan", "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()},
           "results": results}
    out = ROOT / "bench" / "results" / "plan.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    for r in results:
        print(f"{r['recipe']:>12} on {r['cluster']:<12} {r['total_nodes']} nodes: compose+validate "
              f"{r['compose_validate_s_median'] * 1e3:.1f} ms, plan {r['plan_s_median'] * 1e3:.2f} ms (median of {REPEATS})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Step data traffic per rank: the routed exchange (hpc_rl/rl/routes.py) against the
world-group object broadcasts it replaced, computed from the exchange plan for
`ultra_mopd`'s 224-node shape and for the local tiny_mopd shape, and measured on a real
local tiny_mopd run (every rank counts its object messages and bytes per step).

    python bench/exchange.py            # writes bench/results/exchange.json

Units: one object message = one pickled Python object from one rank to another (a group
broadcast counts one per receiving member, as gloo's broadcast sends root -> each rank).
Bytes of the flagship's rows are the pickled size of a synthetic sample of the stated
prompt/response lengths (an assumption: agents stop well before max_tokens)."""

from __future__ import annotations

import json
import pickle
import statistics
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc_rl.config import load_config  # noqa: E402
from hpc_rl.plan import build_plan  # noqa: E402
from hpc_rl.refit.vllm_engine import SampleRow  # noqa: E402
from hpc_rl.messaging.routes import Routes  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "exchange.json"
LOCAL = ["+recipe=tiny_mopd", "run.max_steps=4", "data.eval_prompts_per_task=0", "algo.prompts_per_step=32",
         "trainer.global_batch_size=32", "data.samples_per_task=32", "checkpoint.every_steps=100",
         "checkpoint.export_final=false"]


def role_of(plan, routes: Routes) -> Dict[int, str]:
    out, k = {}, 0
    for r in plan.roles:
        for _ in range(r.tasks):
            out[k] = r.name.split("/")[0]
            k += 1
    return out


def per_rank(messages) -> Dict[int, Counter]:
    c: Dict[int, Counter] = defaultdict(Counter)
    for _, src, dst in messages:
        c[src]["sent"] += 1
        c[dst]["received"] += 1
    return c


def before_messages(routes: Routes, world: int):
    """The old loop: per step one world broadcast each of the stop flag and the prompts
    (driver), of every generator's rows, every env rank's rewards and every teacher
    group's log-probs."""
    producers = [routes.driver, routes.driver, *routes.generators, *routes.envs,
                 *(ranks[0] for ranks in routes.teachers.values())]
    return [("world", p, r) for p in producers for r in range(world) if r != p]


def summarize(counts: Dict[int, Counter], roles: Dict[int, str]) -> Dict[str, dict]:
    by: Dict[str, List[int]] = defaultdict(list)
    for rank, role in roles.items():
        by[role].append(counts[rank]["sent"] + counts[rank]["received"])
    return {role: {"ranks": len(v), "max": max(v), "mean": round(sum(v) / len(v), 1)} for role, v in by.items()}


def model(overrides: List[str], prompt_tokens: int, response_tokens: int) -> dict:
    cfg = load_config([*overrides, "launcher=dry_run"])
    plan = build_plan(cfg)
    routes = Routes.from_plan(plan)
    world = sum(r.tasks for r in plan.roles)
    roles = role_of(plan, routes)
    samples = cfg.algo.prompts_per_step * cfg.algo.generations_per_prompt
    row = pickle.dumps(SampleRow(list(range(prompt_tokens)), list(range(response_tokens)), [-1.5] * response_tokens,
                                 False, "x" * (4 * response_tokens)), protocol=pickle.HIGHEST_PROTOCOL)
    g = len(routes.generators)
    # bytes a generator's share of rows takes (each sample goes to env, its teacher and the driver now; to everyone before)
    share_bytes = len(row) * samples / g
    before, after = before_messages(routes, world), routes.step_messages()
    b_bytes = Counter()
    for p in set(s for _, s, _ in before):
        if p in routes.generators:
            b_bytes["received_per_rank"] += share_bytes
    after_rx = Counter()
    for what, src, dst in after:
        if what == "rows":
            after_rx[dst] += share_bytes if dst == routes.driver else share_bytes / max(1, len(routes.teachers))
    return {"overrides": overrides, "world": world, "samples_per_step": samples, "generators": g,
            "assumed_tokens": {"prompt": prompt_tokens, "response": response_tokens}, "row_bytes": len(row),
            "messages_per_rank_per_step": {"before": summarize(per_rank(before), roles),
                                           "after": summarize(per_rank(after), roles)},
            "row_bytes_received_per_step": {
                "before_every_rank": int(b_bytes["received_per_rank"]),
                "after_generator": 0,
                "after_env_rank_max": int(max([after_rx[e] for e in routes.envs] or [0])),
                "after_teacher_head_max": int(max([after_rx[t[0]] for t in routes.teachers.values()] or [0])),
                "after_driver": int(after_rx[routes.driver]),
                "note": "trainer ranks receive the whole batch in both designs (they train on it)"}}


def measure() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", *LOCAL, f"run.dir={run}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise SystemExit(f"local run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        out = {}
        for f in sorted((run / "exchange").glob("*.json")):
            data = json.loads(f.read_text())
            steps = [v for k, v in data["per_step"].items() if 1 < int(k) < 4]  # steady steps (not the first, last)
            msgs = [s.get("sent_messages", 0) + s.get("received_messages", 0) for s in steps]
            out[f.stem] = {"messages_per_step": statistics.median(msgs) if msgs else None,
                           "bytes_per_step": statistics.median([s.get("sent_bytes", 0) + s.get("received_bytes", 0)
                                                                for s in steps]) if steps else None}
        return out


def main() -> int:
    flagship = model(["+recipe=ultra_mopd"], prompt_tokens=2048, response_tokens=16384)
    local_model = model(LOCAL, prompt_tokens=20, response_tokens=6)
    measured = measure()
    result = {"ultra_mopd": flagship, "tiny_mopd_model": local_model, "tiny_mopd_measured_per_rank": measured}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result["ultra_mopd"]["messages_per_rank_per_step"], indent=1))
    print(json.dumps(measured, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

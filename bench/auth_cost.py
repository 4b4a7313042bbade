"""What authentication costs per training step in `tiny_mopd` (issue 29: goal < 1%).

There is no switch that turns authentication off (none should exist), so the cost is
counted and priced, side by side in one run of this script:

1. one real local tiny_mopd run (4 steps): every rank counts its authenticated work per
   step (runtime/auth_stats.py: SignedStore calls by method and their keys and bytes,
   sealed messages and their bytes; its engine's worker processes apart, as totals) and
   the run records its step times;
2. on a TCPStore served on this machine, each SignedStore method timed against the raw
   store doing the same thing (get: get; peek: check + get; check/wait: the raw call,
   which reads no value: the signed one adds one get per key), at the run's mean value
   sizes and keys per call, in alternating rounds; sealing and opening a message at the
   1 KB and 64 KB timed against nothing (a pickle with no MAC), priced per message by
   its bytes;
3. per rank: ops per steady step x the extra time per op, against the step's time.

    python bench/auth_cost.py            # writes bench/results/auth_cost.json

It prices CPU time and the extra store round trips on localhost. On a cluster a store
round trip crosses the network: the extra gets of check/wait (one per key) are also
reported per step, with their cost at 100 us each, for that case.
"""

from __future__ import annotations

import json
import math
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from hpc_rl.launchers.local import free_port  # noqa: E402
from hpc_rl.runtime.signed_store import SignedStore, ensure_job_key, job_key, seal, unseal  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "auth_cost.json"
STEPS = 4
LOCAL = ["+recipe=tiny_mopd", f"run.max_steps={STEPS}", "data.eval_prompts_per_task=0", "algo.prompts_per_step=32",
         "trainer.global_batch_size=32", "data.samples_per_task=32", "checkpoint.every_steps=100",
         "checkpoint.export_final=false"]
STEADY = range(2, STEPS)  # not the first step (engine warm-up), not the last (it holds the run's end)
ROUNDS, N = 7, 400
NETWORK_RTT_US = 100.0  # a store round trip across a cluster network, for the sensitivity figure


def run_tiny_mopd(run: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", *LOCAL, f"run.dir={run}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"local run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def ranged(xs: List[float]) -> List[float]:
    """[min, median, max]."""
    return [min(xs), statistics.median(xs), max(xs)]


def side_by_side(raw: Callable[[], None], signed: Callable[[], None]) -> Dict[str, List[float]]:
    """Microseconds per op, raw and signed, in alternating rounds; delta per round pair."""
    r_us, s_us = [], []
    for _ in range(ROUNDS):
        for fn, out in ((raw, r_us), (signed, s_us)):
            t0 = time.perf_counter()
            for _ in range(N):
                fn()
            out.append((time.perf_counter() - t0) / N * 1e6)
    return {"raw_us": ranged(r_us), "signed_us": ranged(s_us), "delta_us": ranged([s - r for s, r in zip(s_us, r_us)])}


def micro(sizes: Dict[str, float]) -> Dict[str, dict]:
    ensure_job_key()
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    signed = SignedStore(raw, job_key())
    value = b"x" * max(1, int(sizes["store_value_bytes"]))
    keys = {m: max(1, math.ceil(sizes[f"{m}_keys_per_call"])) for m in ("check", "wait")}
    for i in range(max(keys.values())):
        raw.set(f"raw/{i}", value)
        signed.set(f"signed/{i}", value)
    raw_keys = {m: [f"raw/{i}" for i in range(k)] for m, k in keys.items()}
    signed_keys = {m: [f"signed/{i}" for i in range(k)] for m, k in keys.items()}
    out = {
        "set": side_by_side(lambda: raw.set("raw/w", value), lambda: signed.set("signed/w", value)),
        "get": side_by_side(lambda: raw.get("raw/0"), lambda: signed.get("signed/0")),
        "peek": side_by_side(lambda: raw.check(["raw/0"]) and raw.get("raw/0"), lambda: signed.peek("signed/0")),
        "check": side_by_side(lambda: raw.check(raw_keys["check"]), lambda: signed.check(signed_keys["check"])),
        "wait": side_by_side(lambda: raw.wait(raw_keys["wait"]), lambda: signed.wait(signed_keys["wait"])),
        "compare_set": side_by_side(lambda: raw.compare_set("raw/0", b"", value),
                                    lambda: signed.compare_set("signed/0", "", value)),
    }
    out["check"]["keys"], out["wait"]["keys"] = keys["check"], keys["wait"]
    for m in ("set", "get", "peek", "compare_set"):
        out[m]["value_bytes"] = len(value)
    secret = job_key()
    for name, size in (("message_1k", 1024), ("message_64k", 65536)):
        msg = pickle.dumps(b"y" * size)
        out[name] = side_by_side(lambda: None, lambda: unseal(secret, "p2p/0->1/0", seal(secret, "p2p/0->1/0", msg)))
        out[name]["bytes"] = len(msg) + 32
        out[name]["note"] = "seal + open of one message (each side does one of the two)"
    host.set("done", b"1")  # the host lives until here
    return out


def mean_sizes(reports: Dict[str, dict]) -> Dict[str, float]:
    tot: Dict[str, float] = {}
    for rep in reports.values():
        for k, v in rep["ops"].items():
            tot[k] = tot.get(k, 0) + v
    return {"store_value_bytes": (tot.get("signed_bytes", 0) + tot.get("verified_bytes", 0)) /
            max(1, tot.get("signs", 0) + tot.get("verifies", 0)) - 32,
            "check_keys_per_call": tot.get("check_keys", 0) / max(1, tot.get("check", 0)),
            "wait_keys_per_call": tot.get("wait_keys", 0) / max(1, tot.get("wait", 0)),
            "message_bytes": (tot.get("msg_sealed_bytes", 0) + tot.get("msg_opened_bytes", 0)) /
            max(1, tot.get("msg_seals", 0) + tot.get("msg_opens", 0))}


def price(ops: Dict[str, float], m: Dict[str, dict], which: int) -> float:
    """Extra microseconds for `ops` at the [min, median, max] `which` of each delta."""
    us = sum(ops.get(k, 0) * m[k]["delta_us"][which] for k in ("set", "get", "peek", "compare_set"))
    us += ops.get("check", 0) * m["check"]["delta_us"][which] + ops.get("wait", 0) * m["wait"]["delta_us"][which]
    # one message costs one seal (sender) or one open (receiver): half the timed pair each,
    # a fixed part and a part per byte (a line through the 1 KB and 64 KB timings)
    small, large = m["message_1k"], m["message_64k"]
    per_byte = (large["delta_us"][which] - small["delta_us"][which]) / (large["bytes"] - small["bytes"])
    fixed = small["delta_us"][which] - per_byte * small["bytes"]
    n = ops.get("msg_seals", 0) + ops.get("msg_opens", 0)
    nbytes = ops.get("msg_sealed_bytes", 0) + ops.get("msg_opened_bytes", 0)
    us += (n * fixed + nbytes * per_byte) / 2
    return us


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        t0 = time.time()
        run_tiny_mopd(run)
        wall = time.time() - t0
        reports = {f.stem: json.loads(f.read_text()) for f in sorted((run / "auth").glob("*.json"))}
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        step_s = {r["step"]: r["timing"]["step_s"] for r in steps if r.get("kind") == "step"}
        summary = json.loads((run / "summary.json").read_text())
    sizes = mean_sizes(reports)
    m = micro(sizes)
    steady_s = [step_s[s] for s in STEADY]
    per_rank = {}
    for name, rep in reports.items():
        per_step = [rep["per_step"].get(str(s), {}) for s in STEADY]
        keys = sorted({k for p in per_step for k in p})
        ops = {k: statistics.median([p.get(k, 0) for p in per_step]) for k in keys}
        workers = rep["engine_workers"]["ops"]  # totals over the run: amortized over its steps (an upper bound)
        ops_all = dict(ops)
        for k, v in workers.items():
            ops_all[k] = ops_all.get(k, 0) + v / STEPS
        us = [price(ops_all, m, i) for i in range(3)]
        extra_rt = ops_all.get("check_keys", 0) + ops_all.get("wait_keys", 0)
        per_rank[name] = {
            "ops_per_steady_step": {k: round(v, 1) for k, v in ops_all.items()},
            "extra_us_per_step": [round(u, 1) for u in us],
            "share_of_step_pct": [round(100 * u / 1e6 / statistics.median(steady_s), 4) for u in us],
            "extra_store_round_trips_per_step": round(extra_rt, 1),
            "share_with_100us_network_round_trips_pct": round(
                100 * (us[1] + extra_rt * NETWORK_RTT_US) / 1e6 / statistics.median(steady_s), 4),
        }
    worst = max(per_rank.values(), key=lambda r: r["share_of_step_pct"][2])
    result = {
        "what": "extra time of authentication (HMAC-SHA256 on store values and messages, the gets that verify "
                "check/wait) per steady training step of a local tiny_mopd run, per rank, priced by timing each "
                "SignedStore method against the raw TCPStore side by side (alternating rounds) on this machine",
        "run": {"overrides": LOCAL, "wall_s": round(wall, 1), "steady_steps": list(STEADY),
                "steady_step_s": [round(x, 3) for x in steady_s],
                "auth_rejected": summary.get("auth_rejected")},
        "mean_sizes": {k: round(v, 1) for k, v in sizes.items()},
        "micro": {k: {kk: ([round(x, 2) for x in vv] if isinstance(vv, list) else vv) for kk, vv in v.items()}
                  for k, v in m.items()},
        "rounds": ROUNDS, "ops_per_round": N,
        "per_rank": per_rank,
        "worst_rank_share_of_step_pct": worst["share_of_step_pct"],
        "goal_pct": 1.0,
        "goal_met": worst["share_of_step_pct"][2] < 1.0,
        "notes": [
            "ranges are [min, median, max] over the alternating rounds of the micro-timings; the step time is the "
            "median of the steady steps",
            "heartbeat threads' store calls (a set and a peek per beat per rank) are counted in the step they "
            "fall in; they run beside the step, so charging them to it overstates the cost",
            "the engine worker's ops are totals over the run divided by its steps (its join included)",
            "on 2 cores timings move by about +-15% from run to run (docs: NOTES)",
        ],
        "machine": "2 cores, torch 2.13 CPU, TCPStore on localhost",
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("worst_rank_share_of_step_pct", "goal_met")}, indent=1))
    for name, r in per_rank.items():
        print(f"{name:<18} extra {r['extra_us_per_step']} us/step, {r['share_of_step_pct']} % of "
              f"{statistics.median(steady_s):.2f} s; {r['extra_store_round_trips_per_step']} extra round trips")
    return 0


if __name__ == "__main__":
    sys.exit(main())

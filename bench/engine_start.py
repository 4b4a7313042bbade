"""How long a generator's vLLM engine takes to start on this machine, with its engine core
in the generator's process (what CPU clusters run: refit/vllm_engine.py in_process_core)
and in a process of its own (vLLM's default, kept on GPU), side by side, alternating.
Each start is a fresh interpreter that imports vLLM, builds the tiny student's engine,
samples 8 prompts and closes it, as a generator rank does.

    python bench/engine_start.py [--pairs 2]   ->  bench/results/engine_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "engine_start.json"

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import hpc_rl.refit.vllm_engine as ve
if sys.argv[2] == "own_process":
    ve.in_process_core = lambda span: False  # bench-only: vLLM's default layout
if __name__ == "__main__":
    g = ve.VLLMGenerator(sys.argv[1], max_model_len=128, max_num_seqs=8)
    t1 = time.perf_counter()
    rows = g.sample(["1+2="] * 8, max_tokens=8, seed=list(range(8)))
    t2 = time.perf_counter()
    g.close()
    t3 = time.perf_counter()
    print("RESULT " + json.dumps({"client": type(g._core()).__name__, "start_s": t1 - t0, "sample_s": t2 - t1,
                                   "close_s": t3 - t2, "texts": [r.text for r in rows]}), flush=True)
"""


def one(model: str, mode: str) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model, mode], capture_output=True, text=True, timeout=600, cwd=ROOT)
    wall = time.perf_counter() - t0
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise SystemExit(f"{mode} failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return dict(json.loads(line[0][7:]), mode=mode, process_wall_s=wall)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    from hpc_rl.rl.inputs import resolve_model_ref

    model = resolve_model_ref("tiny:student")
    runs = []
    for _ in range(args.pairs):
        for mode in ("in_process", "own_process"):
            runs.append(one(model, mode))
            print(f"{mode:12s} start {runs[-1]['start_s']:.1f} s, process {runs[-1]['process_wall_s']:.1f} s", flush=True)
    texts = {json.dumps(r["texts"]) for r in runs}
    summary = {m: {k: [round(min(r[k] for r in runs if r["mode"] == m), 2), round(max(r[k] for r in runs if r["mode"] == m), 2)]
                   for k in ("start_s", "process_wall_s")} for m in ("in_process", "own_process")}
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_avg_1min_at_end": os.getloadavg()[0], "same_samples_in_both_modes": len(texts) == 1,
              "range_min_max": summary, "runs": runs}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(summary), "same samples:", len(texts) == 1)


if __name__ == "__main__":
    main()

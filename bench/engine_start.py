"""How long a generator's vLLM engine takes to start on this machine, with its engine core
in the generator's process (what CPU clusters run: refit/vllm_engine.py in_process_core)
and in a process of its own (vLLM's default, kept on GPU), and with the share of memory
it takes (generator.gpu_memory_utilization: the tiny recipes' 0.06 against their former
0.2), side by side, alternating. Each start is a fresh interpreter that imports vLLM,
builds the tiny student's engine, samples 8 prompts and closes it, as a generator rank
does; the CPU seconds are its own and its engine workers'.

    python bench/engine_start.py [--pairs 2] [--variants in_process:0.2,in_process:0.06,own_process:0.2]
        ->  bench/results/engine_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
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
    g = ve.VLLMGenerator(sys.argv[1], max_model_len=128, max_num_seqs=8, memory_fraction=float(sys.argv[3]))
    t1 = time.perf_counter()
    rows = g.sample(["1+2="] * 8, max_tokens=8, seed=list(range(8)))
    t2 = time.perf_counter()
    g.close()
    t3 = time.perf_counter()
    print("RESULT " + json.dumps({"client": type(g._core()).__name__, "start_s": t1 - t0, "sample_s": t2 - t1,
                                   "close_s": t3 - t2, "texts": [r.text for r in rows]}), flush=True)
"""


def one(model: str, mode: str, fraction: float) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model, mode, str(fraction)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the child and the engine workers it waited for
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise SystemExit(f"{mode} failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return dict(json.loads(line[0][7:]), mode=mode, memory_fraction=fraction, variant=f"{mode}:{fraction}",
                process_wall_s=wall, cpu_user_s=after.ru_utime - before.ru_utime, cpu_sys_s=after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--variants", default="in_process:0.2,in_process:0.06,own_process:0.2",
                    help="mode:memory_fraction, comma-separated")
    args = ap.parse_args()
    from hpc_rl.rl.inputs import resolve_model_ref

    model = resolve_model_ref("tiny:student")
    variants = [(v.split(":")[0], float(v.split(":")[1])) for v in args.variants.split(",")]
    runs = []
    for _ in range(args.pairs):
        for mode, fraction in variants:
            runs.append(one(model, mode, fraction))
            r = runs[-1]
            print(f"{r['variant']:18s} start {r['start_s']:.1f} s, process {r['process_wall_s']:.1f} s, "
                  f"cpu {r['cpu_user_s']:.1f} user + {r['cpu_sys_s']:.1f} sys", flush=True)
    texts = {json.dumps(r["texts"]) for r in runs}
    keys = ("start_s", "process_wall_s", "cpu_user_s", "cpu_sys_s")
    summary = {f"{m}:{f}": {k: [round(min(r[k] for r in runs if r["variant"] == f"{m}:{f}"), 2),
                                 round(max(r[k] for r in runs if r["variant"] == f"{m}:{f}"), 2)] for k in keys}
               for m, f in variants}
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_avg_1min_at_end": os.getloadavg()[0], "same_samples_in_every_variant": len(texts) == 1,
              "range_min_max": summary, "runs": runs}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(summary), "same samples:", len(texts) == 1)


if __name__ == "__main__":
    main()

"""The probe for issue #30 that led tp=1 CPU engines to run their worker in the generator rank
(refit/vllm_engine.py hidden_job_world, the same swap as below). Its question: can a generator rank, already in the
job's default (gloo) process group, run vLLM's worker in its own process (the uni executor)
instead of spawning a worker process that imports vLLM a second time?

vLLM's worker initialises torch.distributed's default group itself; a rank already has the
job's. The probe hides the job's world from vLLM while the engine is built (it swaps
torch.distributed_c10d's private `_world` for a fresh one, then puts the job's back), samples,
and checks the job's group still reduces. It runs a 2-rank job of its own (rank 1 builds
the engine) for each variant, alternating:

  mp_worker   what CPU clusters run today (refit/vllm_engine.py: in-process core, one
              spawned worker process, `distributed_executor_backend="mp"`)
  uni_swap    the worker inside the rank, the world swapped around `LLM()`

and records each run's wall time and the machine's busy CPU seconds over it (/proc/stat: both
ranks and the engine's worker process, which the rank does not wait for; so also whatever
else ran, on an otherwise idle machine).

    python bench/inprocess_worker_probe.py [--rounds 2]  ->  bench/results/inprocess_worker_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "inprocess_worker_probe.json"

RANK = r"""
import json, os, sys, time
import torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

rank, port, model, variant = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
out = {}
if rank == 1:
    t0 = time.perf_counter()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    args = dict(model=model, dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
                gpu_memory_utilization=0.06, max_num_seqs=8)
    if variant == "uni_swap":
        job_world = c10d._world
        c10d._world = c10d._World()  # vLLM finds no default group and makes its own (world 1)
        llm = LLM(**args, distributed_executor_backend="uni")
        c10d._world = job_world
    else:
        llm = LLM(**args, distributed_executor_backend="mp")
    t1 = time.perf_counter()
    rows = llm.generate(["1+2="] * 8, SamplingParams(max_tokens=8, temperature=1.0, seed=1))
    out = {"start_s": t1 - t0, "texts": [r.outputs[0].text for r in rows],
           "job_world_after": dist.get_world_size()}
t = torch.ones(1) * 10
dist.all_reduce(t)
out["job_allreduce_after"] = t.item()
if rank == 1:
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # the engine's teardown is not what is measured
"""


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat, all CPUs)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one(model: str, variant: str) -> dict:
    port = _free_port()
    other = subprocess.Popen([sys.executable, "-c", RANK, "0", str(port), model, variant],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    busy0 = _busy_s()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RANK, "1", str(port), model, variant], capture_output=True,
                          text=True, timeout=600)
    wall = time.perf_counter() - t0
    busy = _busy_s() - busy0
    other.wait(timeout=120)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise SystemExit(f"{variant} failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return dict(json.loads(line[0][7:]), variant=variant, rank_wall_s=wall, machine_busy_cpu_s=busy)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from hpc_rl.rl.inputs import resolve_model_ref

    model = resolve_model_ref("tiny:student")
    variants = ("mp_worker", "uni_swap")
    runs = []
    for _ in range(args.rounds):
        for v in variants:
            runs.append(one(model, v))
            r = runs[-1]
            print(f"{v:10s} start {r['start_s']:.1f} s, rank {r['rank_wall_s']:.1f} s, "
                  f"machine busy {r['machine_busy_cpu_s']:.1f} CPU s, job allreduce after "
                  f"{r['job_allreduce_after']}", flush=True)
    keys = ("start_s", "rank_wall_s", "machine_busy_cpu_s")
    summary = {v: {k: [round(min(r[k] for r in runs if r["variant"] == v), 2),
                       round(max(r[k] for r in runs if r["variant"] == v), 2)] for k in keys} for v in variants}
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_avg_1min_at_end": os.getloadavg()[0],
              "same_samples_in_both": len({json.dumps(r["texts"]) for r in runs}) == 1,
              "job_group_intact_in_all": all(r["job_allreduce_after"] == 20.0 and r["job_world_after"] == 2 for r in runs),
              "range_min_max": summary, "runs": runs}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(summary), "same samples:", record["same_samples_in_both"], "job group intact:",
          record["job_group_intact_in_all"])


if __name__ == "__main__":
    main()

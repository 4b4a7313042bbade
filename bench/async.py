"""Lock-step vs asynchronous rollouts (#15), side by side in one run.

    python bench/async.py                 # writes bench/results/async.json
    python bench/async.py --skip-mopd     # the tiny_grpo comparison only

grpo runs three: lock-step, async (weights loaded between collections) and async with
in-flight weight updates (loaded mid-generation).

grpo: `tiny_grpo` (no teachers) with the trainer pinned to CPU 0 and the generator (and the
env rank, whose verifiers cost little) to CPU 1, one thread each (HPC_RL_CPU_AFFINITY), as
separate nodes would be. Generation and training are sized to take similar time. Measured
per run, over the steps after the first (start-up and the first engine step excluded):
samples per second (samples / summed step seconds), the trainer's idle share (lock-step: the
driver's time from ordering to having the rows, `generate_s`; its wait for the scores after
the student's log-probs is not counted; async: its time blocked gathering rows and scores,
`wait_rows_s`), and the generator's idle share (1 - its sampling seconds / step seconds).

mopd: `tiny_mopd` (two teachers, every role a process on the same two cores, teachers
pinned with the trainer) for its full recipe length, lock-step and async: the reverse KL to
the teachers at the start and the end, and the step at which each run first reaches 90% of
the lock-step run's total KL cut (the issue's "as much, within the same steps +-10%").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "async.json"
PIN_GRPO = "trainer=0;generator=1;env=1"
PIN_MOPD = "trainer=0;teacher/add=0;teacher/mul=0;generator=1;env=1"


def launch(run: Path, overrides: List[str], pin: str) -> Dict:
    env = dict(os.environ, HPC_RL_CPU_AFFINITY=pin)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", *overrides, f"run.dir={run}"], capture_output=True,
                          text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({proc.returncode}): {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": time.time() - t0, "rows": rows, "summary": json.loads((run / "summary.json").read_text())}


def throughput(rows: List[Dict], asynchronous: bool) -> Dict:
    steps = [r for r in rows if r["kind"] == "step"][1:]  # the first step pays the engine's warm-up
    step_s = [r["timing"]["step_s"] for r in steps]
    samples = sum(r["samples"] for r in steps)
    if asynchronous:
        idle = [r["timing"]["wait_rows_s"] for r in steps]
        gen = [r["timing"]["generate_busy_s"] for r in steps]
    else:
        idle = [r["timing"]["generate_s"] for r in steps]
        gen = [r["timing"]["generate_s"] for r in steps]  # the driver's view: ordering to rows (sampling and sends)
    out = {"steps_measured": len(steps), "samples": samples, "samples_per_s": samples / sum(step_s),
           "step_s_mean": statistics.mean(step_s), "step_s_range": [min(step_s), max(step_s)],
           "train_s_mean": statistics.mean(r["timing"]["train_s"] for r in steps),
           "refit_s_mean": statistics.mean(r["timing"]["refit_s"] for r in steps),
           "trainer_idle_s_mean": statistics.mean(idle), "trainer_idle_frac": sum(idle) / sum(step_s),
           "generator_busy_s_mean": statistics.mean(gen), "generator_idle_frac": max(0.0, 1 - sum(gen) / sum(step_s))}
    if asynchronous:
        out["buffer_depth_max"] = max(r["async"]["buffer_depth"] for r in steps)
        out["stale_dropped"] = sum(r["async"]["stale_dropped"] for r in steps)
    # samples whose tokens came from two weight versions (a refit landed mid-generation)
    out["changed_mid_sample"] = sum(r["versions"]["changed_mid_sample"] for r in steps)
    ages: Dict[str, int] = {}
    for r in steps:
        for a, n in r["versions"]["age"].items():
            ages[a] = ages.get(a, 0) + n
    out["age_histogram"] = ages
    return out


def kl_curve(rows: List[Dict]) -> List[float]:
    return [r["reverse_kl"]["mean"] for r in rows if r["kind"] == "step"]


def first_step_reaching(curve: List[float], target: float, window: int = 5) -> Optional[int]:
    """The first step whose trailing mean KL (over `window` steps: single batches are noisy) is at or below target."""
    for i in range(window - 1, len(curve)):
        if statistics.mean(curve[i - window + 1:i + 1]) <= target:
            return i + 1
    return None


def kl_comparison(out: Dict, window: int = 5) -> Dict:
    """When each run's training-batch reverse KL (trailing mean of `window` steps) first reaches
    90% of the lock-step run's own cut (its first `window` steps' mean to its last's)."""
    curve = out["sync"]["kl_curve"]
    start, end = statistics.mean(curve[:window]), statistics.mean(curve[-window:])
    target = start - 0.9 * (start - end)
    reach = {k: first_step_reaching(out[k]["kl_curve"], target, window) for k in ("sync", "async")}
    res: Dict = {"kl_target_90pct_of_sync_cut": target, "steps_to_90pct_of_sync_kl_cut": reach}
    if reach["sync"] and reach["async"]:
        res["async_steps_over_sync"] = reach["async"] / reach["sync"]
        res["within_10pct_steps"] = abs(reach["async"] / reach["sync"] - 1) <= 0.10
    return res


def grpo(tmp: Path, args) -> Dict:
    base = ["+recipe=tiny_grpo", f"run.max_steps={args.steps}", f"algo.prompts_per_step={args.prompts}",
            "algo.generations_per_prompt=8", f"trainer.global_batch_size={args.prompts * 8}",
            f"generator.sampling.max_tokens={args.max_tokens}", f"generator.sampling.min_tokens={args.min_tokens}",
            f"trainer.micro_batch_size={args.micro_batch}",
            "data.eval_prompts_per_task=0",
            "checkpoint.every_steps=1000", "checkpoint.export_final=false"]
    out = {"overrides": base, "pin": PIN_GRPO}
    runs = (("sync", []), ("async", ["algo.async_rollout.enabled=true"]),
            ("async_in_flight", ["algo.async_rollout.enabled=true", "algo.async_rollout.in_flight_weight_updates=true"]))
    for name, extra in runs:
        res = launch(tmp / f"grpo_{name}", base + extra, PIN_GRPO)
        out[name] = dict(throughput(res["rows"], name != "sync"), wall_s=res["wall_s"],
                         reward_first_steps_mean=res["summary"].get("reward_first_steps_mean"),
                         reward_last_steps_mean=res["summary"].get("reward_last_steps_mean"))
    out["async_over_sync_samples_per_s"] = out["async"]["samples_per_s"] / out["sync"]["samples_per_s"]
    out["async_in_flight_over_sync_samples_per_s"] = out["async_in_flight"]["samples_per_s"] / out["sync"]["samples_per_s"]
    out["goal"] = {"async_over_sync_at_least": 1.5, "trainer_idle_frac_below": 0.2,
                   **{f"met_{k}": out[f"{k}_over_sync_samples_per_s"] >= 1.5 and out[k]["trainer_idle_frac"] < 0.2
                      for k in ("async", "async_in_flight")}}
    return out


def mopd(tmp: Path, args) -> Dict:
    base = ["+recipe=tiny_mopd", "checkpoint.every_steps=1000", "checkpoint.export_final=false",
            *([f"run.max_steps={args.mopd_steps}"] if args.mopd_steps else [])]
    out: Dict = {"overrides": base, "pin": PIN_MOPD}
    for name, extra in (("sync", []), ("async", ["algo.async_rollout.enabled=true"])):
        res = launch(tmp / f"mopd_{name}", base + extra, PIN_MOPD)
        s = res["summary"]
        out[name] = dict(throughput(res["rows"], name == "async"), wall_s=res["wall_s"],
                         reverse_kl_start=s["start"]["reverse_kl"], reverse_kl_end=s["end"]["reverse_kl"],
                         reverse_kl_reduction=s.get("reverse_kl_reduction"), kl_curve=kl_curve(res["rows"]))
    out.update(kl_comparison(out))
    out["eval_kl_cut"] = {k: 1 - out[k]["reverse_kl_end"]["mean"] / out[k]["reverse_kl_start"]["mean"]
                          for k in ("sync", "async")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=6)
    # the tiny student answers in about 3 tokens whatever max_tokens allows: min_tokens sizes
    # the generation side, the micro-batch size the trainer's (more forward/backward passes)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--only", choices=("grpo", "mopd"), help="rerun one section, keeping the other from the results file")
    p.add_argument("--skip-mopd", action="store_true")
    p.add_argument("--mopd-steps", type=int, default=0, help="0: the recipe's own run.max_steps")
    args = p.parse_args()
    result = json.loads(RESULTS.read_text()) if args.only and RESULTS.exists() else {}
    result.update({"bench": "async", "time": time.time(), "machine": {"cpus": os.cpu_count()}})
    if "mopd" in result:  # kept from an earlier run: its comparison by this version's rule
        result["mopd"].update(kl_comparison(result["mopd"]))
    # other work on the machine skews every timing: the load average before each section
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        if args.only in (None, "grpo"):
            load = os.getloadavg()[0]
            result["grpo"] = dict(grpo(Path(tmp), args), load_avg_1min_before=load, load_avg_1min_after=os.getloadavg()[0])
            print(json.dumps({k: result["grpo"][k] for k in ("async_over_sync_samples_per_s",
                                                              "async_in_flight_over_sync_samples_per_s", "goal")}))
        if args.only == "mopd" or (args.only is None and not args.skip_mopd):
            load = os.getloadavg()[0]
            result["mopd"] = dict(mopd(Path(tmp), args), load_avg_1min_before=load, load_avg_1min_after=os.getloadavg()[0])
    RESULTS.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

"""The chaos drills with asynchronous rollouts and in-flight weight updates on (#15), on the
local Slurm cluster: USR1 before the time limit, and the generator SIGKILLed when step 4's
order reaches it.

Where an in-flight refit lands depends on timing, so unlike tests/test_async_chaos.py (async
without in-flight updates) the weights are not compared bitwise with an uninterrupted run.
Measured per drill: did it finish, how it resumed, whether every step's samples were trained
exactly once (each step's group present once, with its full row count), whether the age bound
held from each sample's first weight version, and how many samples straddled two versions.
Writes bench/results/async_drills.json.

    make cluster-up && python bench/async_drills.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import h5py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hpc_rl.slurm import chaos  # noqa: E402

OUT = ROOT / "bench" / "results" / "async_drills.json"
STEPS, ROWS = 6, 16
RUN = ["+recipe=tiny_grpo", "cluster=local_slurm", f"run.max_steps={STEPS}", "algo.prompts_per_step=8",
       "algo.generations_per_prompt=2", f"trainer.global_batch_size={ROWS}", "data.samples_per_task=16",
       "data.eval_prompts_per_task=0", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
       "launcher.slurm.signal_grace_s=60", "algo.async_rollout.enabled=true",
       "algo.async_rollout.in_flight_weight_updates=true"]


def samples(run: Path) -> dict:
    with h5py.File(run / "rollouts.h5", "r") as f:
        names = sorted(f)
        firsts = {n: f[n]["weight_version_first"][:] for n in names}
        lasts = {n: f[n]["weight_version_last"][:] for n in names}
        rows = {n: len(f[n]["input_ids"]) for n in names}
    want = [f"step_{s:06d}" for s in range(1, STEPS + 1)]
    return {"every_step_once": names == want and set(rows.values()) == {ROWS},
            "age_bound_held": all(((int(n[5:]) - 1) - firsts[n] <= 1).all() for n in names),
            "straddled": int(sum((lasts[n] != firsts[n]).sum() for n in names)), "samples": sum(rows.values())}


def main() -> int:
    out = {"bench": "async_drills", "overrides": RUN, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with tempfile.TemporaryDirectory(prefix="async_drills_") as tmp:
        base = Path(tmp)
        t0 = time.monotonic()
        res = chaos.usr1_mid_run(base / "usr1", RUN, after_steps=2)
        out["usr1"] = {"finished": res.finished, "checkpoint_saved": res.events.get("checkpoint_saved"),
                       "stopped_after_step": res.events.get("stopped_after_step"),
                       "restarts": [{k: r.get(k) for k in ("restart", "resumed_from_step", "steps_recomputed")}
                                    for r in res.restarts],
                       **samples(base / "usr1"), "wall_s": round(time.monotonic() - t0, 1)}
        print(json.dumps(out["usr1"]), flush=True)
        t0 = time.monotonic()
        job = chaos.launch(base / "kill", [*RUN, "ft.inject_failure=generator:0:kill@4"])
        res = chaos.result(base / "kill", job, chaos.follow(base / "kill", job), t0)
        out["generator_kill"] = {"finished": res.finished,
                                 "restarts": [{k: r.get(k) for k in ("restart", "resumed_from_step", "steps_recomputed")}
                                              for r in res.restarts],
                                 **samples(base / "kill"), "wall_s": round(time.monotonic() - t0, 1)}
        print(json.dumps(out["generator_kill"]), flush=True)
    out["met"] = all(out[d]["finished"] and out[d]["every_step_once"] and out[d]["age_bound_held"]
                     for d in ("usr1", "generator_kill"))
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {OUT}")
    return 0 if out["met"] else 1


if __name__ == "__main__":
    sys.exit(main())

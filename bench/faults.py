"""Fault-tolerance measurements on the local Slurm cluster (and one local-launcher case).

For each chaos case: did the run finish, do its final weights equal an uninterrupted
run's (sha256 of the trained state), how many steps were computed twice; plus seconds
from USR1 to a checkpoint on disk (which includes the rest of the step the drill stalls,
see hpc_rl/slurm/chaos.py; `save_s` is the save alone) and from a rank freezing to its
detection by heartbeats.
Writes bench/results/faults.json.

    make cluster-up && python bench/faults.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hpc_rl.rundir import RunDir  # noqa: E402
from hpc_rl.slurm import chaos  # noqa: E402

OUT = ROOT / "bench" / "results" / "faults.json"
RUN = ["+recipe=tiny_grpo", "cluster=local_slurm", "run.max_steps=6", "algo.prompts_per_step=8",
       "algo.generations_per_prompt=2", "trainer.global_batch_size=16", "data.samples_per_task=16",
       "data.eval_prompts_per_task=0", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
       "launcher.slurm.signal_grace_s=60"]


def case(res: chaos.DrillResult, ref: chaos.DrillResult) -> dict:
    return {"finished": res.finished, "state": res.state, "seconds": round(res.seconds, 1),
            "weights_match_uninterrupted": res.summary.get("final_weights_sha256") == ref.summary.get("final_weights_sha256")
            if res.summary else False,
            "restarts": res.restarts, "steps_recomputed": sum(r["steps_recomputed"] for r in res.restarts),
            "job_exit": res.job_exit, **res.events}


def heartbeat_detection(tmp: Path, timeout_s: float = 4.0, interval_s: float = 0.5) -> dict:
    """A frozen (SIGSTOP) generator in a local comm_check job: seconds it stayed silent
    before trainer rank 0 declared it dead, against the configured timeout."""
    run = tmp / "hb"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+recipe=comm_check", f"run.dir={run}",
                           "ft.inject_failure=generator:0:freeze", f"ft.heartbeat_interval_s={interval_s}",
                           f"ft.heartbeat_timeout_s={timeout_s}"], capture_output=True, text=True, cwd=ROOT)
    verdict = RunDir(run).dead_rank(0).read_text().strip()
    silent = float(verdict.split("for ")[1].split("s")[0])
    return {"verdict": verdict, "silent_s_at_detection": silent, "timeout_s": timeout_s, "interval_s": interval_s,
            "launcher_exit": proc.returncode, "job_seconds": round(time.monotonic() - t0, 1)}


def main() -> int:
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        out["heartbeat"] = heartbeat_detection(tmp)
        print("heartbeat:", out["heartbeat"], flush=True)
        ref = chaos.uninterrupted(tmp / "ref", RUN)
        out["uninterrupted"] = {"finished": ref.finished, "seconds": round(ref.seconds, 1),
                                "final_weights_sha256": ref.summary.get("final_weights_sha256")}
        print("uninterrupted:", out["uninterrupted"], flush=True)
        out["usr1_mid_run"] = case(chaos.usr1_mid_run(tmp / "usr1", RUN, after_steps=2), ref)
        print("usr1:", out["usr1_mid_run"], flush=True)

        t0 = time.monotonic()
        job = chaos.launch(tmp / "kill", [*RUN, "ft.inject_failure=generator:0:kill@4"])
        out["generator_killed"] = case(chaos.result(tmp / "kill", job, chaos.follow(tmp / "kill", job), t0), ref)
        print("kill:", out["generator_killed"], flush=True)

        out["external_requeue"] = case(chaos.external_requeue(tmp / "rq", RUN, after_steps=3), ref)
        print("requeue:", out["external_requeue"], flush=True)

        t0 = time.monotonic()
        job = chaos.launch(tmp / "budget", [*RUN, "ft.max_restarts=0", "ft.inject_failure=generator:0:kill@2"])
        res = chaos.result(tmp / "budget", job, chaos.follow(tmp / "budget", job), t0)
        out["retry_budget_exhausted"] = {"state": res.state, "detail": res.job_exit.get("detail"),
                                         "finished": res.finished, "seconds": round(res.seconds, 1)}
        print("budget:", out["retry_budget_exhausted"], flush=True)
    out["notes"] = ("local Slurm 22.05 on 2 cores; requeue holds (BeginTime, ~2 min) released with "
                    "scontrol update StartTime=now; tiny_grpo, 6 steps, checkpoint every 2")
    out["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

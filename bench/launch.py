"""Seconds from `python -m hpc_rl.launch` to every rank rendezvoused, on the local Slurm
cluster, split into phases:

  submit      CLI start -> sbatch accepted (python start, compose, validate, preflight, sbatch)
  queue       sbatch accepted -> the batch shell starts (Slurm scheduling)
  start       batch shell start -> the last rank has started python and imported torch (srun, imports)
  rendezvous  that moment -> the last rank has met all others on the TCPStore and built every process group

The job is `+recipe=comm_check cluster=local_slurm`: trainer 2 tasks on 2 nodes, generator,
teacher and env 1 each. Writes bench/results/launch.json.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc_rl.rundir import RunDir  # noqa: E402
from hpc_rl.slurm.executor import job_from_run_dir  # noqa: E402
from hpc_rl.slurm.watch import follow  # noqa: E402

REPEATS = 3


def one_launch(run_dir: Path) -> dict:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", "+recipe=comm_check", "cluster=local_slurm",
                           "launcher=slurm", f"run.dir={run_dir}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed:\n{proc.stdout}\n{proc.stderr}")
    t_cli_exit = time.time()
    t_submitted = RunDir(run_dir).job_meta.stat().st_mtime  # written as soon as sbatch answered
    job = job_from_run_dir(run_dir)
    state = follow(job, poll_s=0.5, timeout_s=300, echo=lambda line: None)
    if state != "COMPLETED":
        raise RuntimeError(f"job {job.job_id} ended {state}: {job.failure()}")
    batch = RunDir(run_dir).batch_log.read_text()
    t_batch = float(re.search(r"started at ([0-9.]+)", batch).group(1))
    timings = [r["timing"] for r in job.results()]
    t_started = max(t["imported"] for t in timings)
    t_ready = max(t["rendezvoused"] for t in timings)
    return {
        "job_id": job.job_id,
        "ranks": len(timings),
        "submit_s": t_submitted - t0,
        "queue_s": t_batch - t_submitted,
        "start_s": t_started - t_batch,
        "rendezvous_s": t_ready - t_started,
        "total_s": t_ready - t0,
        "python_start_to_imported_s_max": max(t["imported"] - t["process_start"] for t in timings),
        "cli_returned_s": t_cli_exit - t0,
    }


def main() -> int:
    subprocess.run(["bash", str(ROOT / "launchers" / "local_slurm.sh"), "up"], check=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="hpc_rl_bench_launch_") as tmp:
        for k in range(REPEATS):
            runs.append(one_launch(Path(tmp) / f"run{k}"))
            print(f"run {k}: " + ", ".join(f"{key} {val:.2f}" for key, val in runs[-1].items() if key.endswith("_s")))
    phases = ["submit_s", "queue_s", "start_s", "rendezvous_s", "total_s", "cli_returned_s"]
    doc = {
        "benchmark": "launch",
        "what": "python -m hpc_rl.launch +recipe=comm_check cluster=local_slurm launcher=slurm, to all ranks rendezvoused",
        "cluster": "local Slurm 22.05, 6 slurmd nodes on one 2-core host (launchers/local_slurm.sh)",
        "ranks": runs[0]["ranks"],
        "repeats": REPEATS,
        "median": {p: statistics.median(r[p] for r in runs) for p in phases},
        "runs": runs,
    }
    out = ROOT / "bench" / "results" / "launch.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print("median: " + ", ".join(f"{p} {v:.2f}s" for p, v in doc["median"].items()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

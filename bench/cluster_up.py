"""Seconds `launchers/local_slurm.sh` takes to bring the local cluster up, with and without
accounting (issue 19: CI pays the fresh start with accounting on every run):

  fresh_accounting   cluster down, no accounting database -> up (MariaDB creates its data
                     directory, slurmdbd its tables, the cluster is registered, nodes idle)
  again_accounting   a second `up` on the running cluster (the idempotent fast path)
  restart_no_acct    ACCOUNTING=0 up from the accounting cluster (slurmd/ctld restart, dbd stops)
  warm_accounting    up with accounting again, database kept (what a restart costs)
  down               everything stopped

Restarts the shared local cluster (hold /tmp/heavy.lock with `flock -o`, so the daemons do
not inherit the lock) and leaves it up with accounting. The apt install is not measured
here (packages already installed); .ci/run pays it once. Writes bench/results/cluster_up.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launchers" / "local_slurm.sh"
STATE = Path(os.environ.get("HPC_RL_SLURM_STATE", "/tmp/hpc_rl_slurm"))


def timed(cmd: str, accounting: int = 1) -> float:
    env = dict(os.environ, ACCOUNTING=str(accounting))
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT), cmd], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"local_slurm.sh {cmd} (ACCOUNTING={accounting}) failed:\n{proc.stdout}\n{proc.stderr}")
    return round(time.monotonic() - t0, 2)


def main() -> None:
    out = {}
    out["down"] = timed("down")
    shutil.rmtree(STATE / "mysql", ignore_errors=True)  # a fresh start: no database yet
    (STATE / "dbd.pass").unlink(missing_ok=True)
    out["fresh_accounting"] = timed("up")
    out["again_accounting"] = timed("up")
    sacct = subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True, timeout=30)
    out["sacct_answers"] = sacct.returncode == 0
    out["restart_no_acct"] = timed("up", accounting=0)
    out["warm_accounting"] = timed("up")
    result = {"what": "seconds of launchers/local_slurm.sh on this machine (2 cores), packages installed",
              "seconds": out, "nodes": 6, "slurmdbd_port": 6827, "mariadb_port": 6828}
    path = ROOT / "bench" / "results" / "cluster_up.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""What each Slurm task runs: `python -m hpc_rl.slurm.rank_entry RUN_DIR`.

Jobs submitted through the executor carry a submitit DelayedSubmission pickle
(`<run_dir>/submitit/<job id>_submitted.pkl`); every rank loads and calls it, like
submitit's own `_submit` does for flat jobs. Scripts submitted by hand have no pickle and
start the worker directly. Either way the outcome lands as submitit result pickles.
"""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__":  # when this task's interpreter started, before heavy imports (launch benchmark)
    from hpc_rl.runtime.env import T_START

    os.environ.setdefault(T_START, repr(time.time()))  # the supervisor's start, if any
from pathlib import Path

from submitit.core import utils as submitit_utils

from hpc_rl.runtime import env
from hpc_rl.runtime.env import RankEnv
from hpc_rl.runtime.results import run_and_record, submitit_folder
from hpc_rl.runtime.worker import run_rank

PICKLE_WAIT_S = 60  # the executor moves the pickle into place right after sbatch returns


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpc_rl.slurm.rank_entry RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    launched = RankEnv.from_env()
    if not launched.pickled:
        return run_and_record(run_dir, lambda: run_rank(str(run_dir)))
    if launched.job_id is None:
        print(f"hpc_rl: {env.PICKLED}=1 but neither {env.JOB_ID} nor Slurm's job id is set", file=sys.stderr)
        return 2
    job_id = launched.job_id
    pickle = submitit_utils.JobPaths(submitit_folder(run_dir), job_id=job_id).submitted_pickle

    def call():
        deadline = time.monotonic() + PICKLE_WAIT_S
        while not pickle.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the submission pickle {pickle} never appeared ({PICKLE_WAIT_S}s)")
            time.sleep(0.2)
        return submitit_utils.DelayedSubmission.load(pickle).result()

    return run_and_record(run_dir, call)


if __name__ == "__main__":
    from hpc_rl.runtime.supervise import exit_now, is_child, supervise

    # the rank itself runs in a child; this process cleans up after it (supervise.py)
    if is_child():
        exit_now(main())
    sys.exit(supervise("hpc_rl.slurm.rank_entry", sys.argv[1:], run_dir=(sys.argv[1:] or [None])[0]))

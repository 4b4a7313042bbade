"""`python -m hpc_rl.launch +recipe=NAME [group=option ...] [key=value ...]`

Compose the Hydra config tree, validate all of it, plan the job, and hand the plan to the
launcher `launcher.name` selects (hpc_rl/launchers/base.py). A bad config exits 2 with
every problem listed and nothing submitted.

`--batch-plan` is for a batch script submitted by hand (slurm/sbatch.py renders the call):
it runs on the allocation, plans the run into run.dir with the checks launcher=slurm makes
before it submits, and exits 2 listing the violations when the config is refused. It skips
only launcher=slurm's cluster queries (sbatch on PATH, the partition, whether roles fit):
Slurm already accepted and allocated this job, and inside a container there is no sbatch
to ask.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from hpc_rl.config import ConfigError, load_config, to_yaml
from hpc_rl.config.compose import available
from hpc_rl.config.trace import write_launch_reads
from hpc_rl.launchers.base import LAUNCHERS
from hpc_rl.launchers.runnable import check_runnable
from hpc_rl.plan import build_plan
from hpc_rl.plan.report import describe
from hpc_rl.rundir import RunDir, private_umask
from hpc_rl.slurm.sbatch import BATCH_PLAN_FLAG

USAGE = """usage: python -m hpc_rl.launch +recipe=NAME [cluster=NAME] [launcher=NAME] [key=value ...]

  recipes:   {recipes}
  clusters:  {clusters}
  launchers: {launchers}

options:
  --show-config   print the resolved config and exit (nothing is planned or launched)
  --check         every check a launch runs before submitting (inputs, the environment's
                  preflight: its tools started and called once), then exit; nothing is written
  {batch_plan}    plan into run.dir with launcher=slurm's checks, launch nothing (for batch scripts)
  -h, --help      this text

examples:
  python -m hpc_rl.launch +recipe=ultra_mopd
  python -m hpc_rl.launch +recipe=ultra_mopd cluster=h100 trainer.nodes=32
  python -m hpc_rl.launch +recipe=ultra_mopd launcher.plan_out=plan.json
  python -m hpc_rl.launch +pipeline=ultra                 # every stage of a pipeline, checked and planned
  python -m hpc_rl.launch +pipeline=tiny_pipeline --wait  # stages as dependent Slurm jobs (hpc_rl/pipeline)
"""
FLAGS = ("--show-config", "--check", BATCH_PLAN_FLAG)
CHECK_FLAG = "--check"
PIPELINE_SELECT = "+pipeline="


def usage() -> str:
    return USAGE.format(recipes=", ".join(available("recipe")), clusters=", ".join(available("cluster")),
                        launchers=", ".join(available("launcher")), batch_plan=BATCH_PLAN_FLAG)


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a.startswith(PIPELINE_SELECT) for a in args):  # a pipeline: every stage a job (hpc_rl/pipeline)
        from hpc_rl.pipeline.cli import launch as launch_pipeline

        return launch_pipeline(args)
    if any(a in ("-h", "--help") for a in args):
        print(usage())
        return 0
    flags = [a for a in args if a.startswith("--")]
    unknown_flags = [f for f in flags if f not in FLAGS]
    if unknown_flags:
        print(f"hpc_rl: unknown option(s) {unknown_flags}\n\n{usage()}", file=sys.stderr)
        return 2
    batch_plan = BATCH_PLAN_FLAG in flags
    overrides = [a for a in args if not a.startswith("--")]
    try:
        cfg = load_config(overrides)
    except ConfigError as err:
        print(f"hpc_rl: {err.render()}", file=sys.stderr)
        return err.exit_code
    if "--show-config" in flags:
        print(to_yaml(cfg), end="")
        return 0

    plan = build_plan(cfg)
    launcher = LAUNCHERS[cfg.launcher.name]  # the schema's Literal admits registered names only
    dataset = None
    try:
        if batch_plan or launcher.starts_ranks or CHECK_FLAG in flags:
            cfg, dataset = check_runnable(cfg)
        if not batch_plan:
            launcher.preflight(cfg, plan)  # before the run directory exists: a refused launch leaves nothing
    except ConfigError as err:
        print(f"hpc_rl: {err.render()}", file=sys.stderr)
        return err.exit_code
    if CHECK_FLAG in flags:
        print(f"hpc_rl: {cfg.run.name}: every check before submission passed (nothing was written or submitted)")
        return 0
    if dataset is not None and dataset.skipped:
        print(f"hpc_rl: {dataset.skipped} malformed rows of {dataset.path} will be skipped (data.skip_invalid): "
              f"first {dataset.errors[0]}", file=sys.stderr)
    # What this launch writes into the run directory (submitit's pickles, job.json), and the ranks
    # launcher=local starts, come out no more open than run.dir_mode (rundir.py): ranks execute them.
    with private_umask(RunDir.mode(cfg)):
        run_dir = RunDir.create(cfg, plan)
        if dataset is not None:
            from hpc_rl.rl.inputs import write_generated

            write_generated(cfg, run_dir.path)
        if batch_plan:
            print(describe(cfg, plan))
            print(f"\nplanned into {run_dir.path}; the batch script starts the ranks")
            code = 0
        else:
            code = launcher.launch(cfg, plan, run_dir, overrides)
        write_launch_reads(run_dir.path)  # planning and launching read config keys too (config/trace.py)
    return code


if __name__ == "__main__":
    sys.exit(main())

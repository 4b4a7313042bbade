"""`python -m hpc_rl.launch +recipe=NAME [group=option ...] [key=value ...]`

Compose the Hydra config tree, validate all of it, plan the job, and hand the plan to the
chosen launcher. A bad config exits 2 with every problem listed and nothing submitted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

from hpc_rl.config import ConfigError, load_config, to_yaml
from hpc_rl.config.compose import available
from hpc_rl.plan import build_plan
from hpc_rl.plan.report import describe
from hpc_rl.launchers.local import launch_local
from hpc_rl.launchers.slurm import launch_slurm
from hpc_rl.run_dir import prepare_run_dir, write_atomic
from hpc_rl.rl.inputs import check_inputs, write_generated
from hpc_rl.rl.records import SUMMARY, render_summary
from hpc_rl.runtime import programs
from hpc_rl.slurm.preflight import check_slurm

USAGE = """usage: python -m hpc_rl.launch +recipe=NAME [cluster=NAME] [launcher=NAME] [key=value ...]

  recipes:   {recipes}
  clusters:  {clusters}
  launchers: {launchers}

options:
  --show-config   print the resolved config and exit (nothing is planned or launched)
  -h, --help      this text

examples:
  python -m hpc_rl.launch +recipe=ultra_mopd
  python -m hpc_rl.launch +recipe=ultra_mopd cluster=h100 trainer.nodes=32
  python -m hpc_rl.launch +recipe=ultra_mopd launcher.plan_out=plan.json
"""


def usage() -> str:
    return USAGE.format(recipes=", ".join(available("recipe")), clusters=", ".join(available("cluster")),
                        launchers=", ".join(available("launcher")))


def print_summary(run_dir: Path) -> None:
    import json

    path = Path(run_dir) / SUMMARY
    if path.exists():
        print(render_summary(json.loads(path.read_text())))
        print(f"  metrics: {run_dir / 'metrics.jsonl'}\n  rollouts: {run_dir / 'rollouts.h5'}\n  summary: {path}")


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(usage())
        return 0
    show_config = "--show-config" in args
    flags = [a for a in args if a.startswith("--")]
    unknown_flags = [f for f in flags if f != "--show-config"]
    if unknown_flags:
        print(f"hpc_rl: unknown option(s) {unknown_flags}\n\n{usage()}", file=sys.stderr)
        return 2
    overrides = [a for a in args if not a.startswith("--")]
    try:
        cfg = load_config(overrides)
    except ConfigError as err:
        print(f"hpc_rl: {err.render()}", file=sys.stderr)
        return err.exit_code
    if show_config:
        print(to_yaml(cfg), end="")
        return 0

    plan = build_plan(cfg)
    name = cfg.launcher.name
    if name != "dry_run" and cfg.run.program not in programs.available():
        # refused before a run directory exists, so nothing is left behind
        print(f"hpc_rl: invalid config: run.program={cfg.run.program!r} has no role loops in this version "
              f"(available: {programs.available()}); nothing was submitted.\n"
              f"      fix: run.program=comm_check checks this job's wiring; launcher=dry_run shows its plan", file=sys.stderr)
        return 2
    if name != "dry_run" and cfg.run.program == "rl":
        try:
            # models, tokenizers, dataset rows and routing, before anything starts or is written
            cfg, dataset = check_inputs(cfg)
        except ConfigError as err:
            print(f"hpc_rl: {err.render()}", file=sys.stderr)
            return err.exit_code
        if dataset.skipped:
            print(f"hpc_rl: {dataset.skipped} malformed rows of {dataset.path} will be skipped (data.skip_invalid): "
                  f"first {dataset.errors[0]}", file=sys.stderr)
    if name == "slurm":
        try:
            check_slurm(cfg, plan)  # before the run directory exists: a refused launch leaves nothing
        except ConfigError as err:
            print(f"hpc_rl: {err.render()}", file=sys.stderr)
            return err.exit_code
    run_dir = prepare_run_dir(cfg, plan)
    if name != "dry_run" and cfg.run.program == "rl":
        write_generated(cfg, run_dir)
    if name == "slurm":
        print(describe(cfg, plan) + "\n")
        return launch_slurm(cfg, plan, run_dir, overrides)
    if name == "local":
        print(describe(cfg, plan) + "\n")
        outcome = launch_local(plan, run_dir, grace_s=cfg.launcher.kill_grace_s)
        if outcome.exit_code:
            print(f"hpc_rl: run failed in {outcome.failed} after {outcome.seconds:.1f}s: {outcome.detail}\n"
                  f"  logs: {run_dir / 'logs'}", file=sys.stderr)
        else:
            print(f"[local] all ranks finished in {outcome.seconds:.1f}s; run directory: {run_dir}")
            print_summary(run_dir)
        return outcome.exit_code
    print(describe(cfg, plan))
    print(f"\nrun directory: {run_dir}")
    print(f"  {run_dir / 'config.yaml'}\n  {run_dir / 'plan.json'}")
    if cfg.launcher.plan_out:
        out = Path(cfg.launcher.plan_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, plan.to_json())
        print(f"  {out}")
    print("dry run: nothing was submitted (launcher=slurm submits this plan)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

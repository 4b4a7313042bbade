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
from hpc_rl.run_dir import prepare_run_dir, write_atomic

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
    if cfg.launcher.name in ("slurm", "local"):
        # Checked before a run directory exists so a refused launch leaves nothing behind.
        print(f"hpc_rl: launcher={cfg.launcher.name} is not available in this version: the het-job executor and "
              f"the local process launcher are being built (see the open issues). Use launcher=dry_run to see the plan.",
              file=sys.stderr)
        return 2
    run_dir = prepare_run_dir(cfg, plan)
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

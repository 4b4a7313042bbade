"""`python -m hpc_rl.plot RUN_DIR [--out DIR]`: PNG plots of a run's metrics.jsonl.

Writes RUN_DIR/plots/*.png (what each shows: hpc_rl/observe/plots.py); a finished run's
driver writes the same at its end. Works on a running run too (the steps so far)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from hpc_rl.rundir import RunDir


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpc_rl.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="where the PNGs go (default RUN_DIR/plots)")
    args = ap.parse_args(argv)
    if not RunDir(args.run_dir).metrics.exists():
        print(f"hpc_rl.plot: {RunDir(args.run_dir).metrics} does not exist: not a run directory, or no step yet",
              file=sys.stderr)
        return 2
    try:
        from hpc_rl.observe.plots import write_plots

        paths = write_plots(args.run_dir, args.out)
    except ImportError as exc:
        print(f"hpc_rl.plot: {exc}; pip install -e '.[observe]' installs matplotlib", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0 if paths else 1


if __name__ == "__main__":
    sys.exit(main())

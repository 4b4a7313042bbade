"""What launchers print about a run once it is done. Launchers import this module, never
hpc_rl.launch: the CLI sits above the launchers, so they cannot import back up into it."""

from __future__ import annotations

import json
from pathlib import Path

from hpc_rl.rundir import RunDir


def print_summary(run_dir: Path) -> None:
    """The RL summary (start vs end) and where the records are, when the run left one."""
    from hpc_rl.rl.records import render_summary  # the RL records pull in numpy/h5py: only when needed

    rd = RunDir(run_dir)
    if rd.summary.exists():
        print(render_summary(json.loads(rd.summary.read_text())))
        print(f"  metrics: {rd.metrics}\n  rollouts: {rd.rollouts}\n  summary: {rd.summary}")

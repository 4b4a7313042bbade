"""The Launcher interface and the registry `launcher.name` selects from.

launch.py composes, validates and plans; then it asks the chosen launcher for its own
checks (`preflight`, before the run directory exists, so a refused launch leaves nothing)
and hands it the run (`launch`). Launchers never import hpc_rl.launch (what they print
after a run is in launchers/report.py), so there is no import circle with the CLI.

Adding a launcher: implement the three members below, add it to LAUNCHERS and to the
`launcher.name` Literal of hpc_rl/config/schema.py and recipes/launcher/<name>.yaml
(tests/test_launchers.py checks they agree).
"""

from __future__ import annotations

from typing import Dict, Protocol, Sequence

from hpc_rl.config.schema import RunConfig
from hpc_rl.plan.job_plan import JobPlan
from hpc_rl.rundir import RunDir

from .dry_run import DryRunLauncher
from .local import LocalLauncher
from .slurm import SlurmLauncher


class Launcher(Protocol):
    name: str
    # Whether ranks will run: launch.py then refuses what a rank could not honour (run.program,
    # models and data, config/support.py's settings) before anything is written.
    starts_ranks: bool

    def preflight(self, cfg: RunConfig, plan: JobPlan) -> None:
        """This launcher's own checks; raise hpc_rl.config.ConfigError listing every problem."""

    def launch(self, cfg: RunConfig, plan: JobPlan, run_dir: RunDir, overrides: Sequence[str] = ()) -> int:
        """Start (or show) the run; the process exit code."""


LAUNCHERS: Dict[str, Launcher] = {
    launcher.name: launcher for launcher in (DryRunLauncher(), LocalLauncher(), SlurmLauncher())
}

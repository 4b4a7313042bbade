"""What a rank could not honour, refused on the launching machine before anything is written.

Used by `python -m hpc_rl.launch` (launch.py) and by pipelines (hpc_rl/pipeline), which check
every stage the same way; it lives under the CLI so that neither imports the other.
"""

from __future__ import annotations

from typing import List, Tuple

from hpc_rl.config.errors import ConfigError, Violation
from hpc_rl.config.schema import RunConfig
from hpc_rl.runtime import programs


def check_runnable(cfg: RunConfig) -> Tuple[RunConfig, object]:
    """What a rank could not honour, refused before anything is written: a run.program with
    no role loops; for the RL program, the settings this version cannot run
    (config/support.py), a role that does not fit its GPUs' memory (config/memory_fit.py) and
    its models, data and routing (rl/inputs.py, which resolves model
    references in the returned config). Raises one ConfigError listing every problem;
    returns the config and the RL dataset (None for other programs).

    The support rules guard what the RL loop would silently ignore (backend, parallel sizes
    it cannot build, async rollouts); run.program=comm_check reads only the layout, and
    checking the wiring of a recipe this version cannot train yet (the flagship's) is what
    it is for, so it is not refused for them."""
    found: List[Violation] = []
    if cfg.run.program not in programs.available():
        found.append(Violation("run.program", cfg.run.program,
                               f"this version has no role loops for it (available: {programs.available()})",
                               "run.program=comm_check checks this job's wiring; launcher=dry_run shows its plan"))
    dataset = None
    if cfg.run.program == "rl":
        from hpc_rl.config.memory_fit import memory_misfits
        from hpc_rl.config.support import unsupported
        from hpc_rl.rl.inputs import check_inputs

        found += unsupported(cfg)
        found += memory_misfits(cfg)  # a role its GPUs cannot hold (config/memory_fit.py)
        try:
            cfg, dataset = check_inputs(cfg)
        except ConfigError as err:
            found += err.violations
        if cfg.env.agentic.environment == "verifiers" and not found:
            from hpc_rl.agentic.verifiers_preflight import preflight

            found += [Violation(*v) for v in preflight(cfg.env.agentic.verifiers, cfg.model.path,
                                                        cfg.env.agentic.tool_parser)]
        if cfg.env.agentic.environment == "gym" and not found:
            from hpc_rl.agentic.gym_bridge import preflight as gym_preflight

            found += [Violation(*v) for v in gym_preflight(cfg.env.agentic.gym)]
    if found:
        raise ConfigError(found)
    return cfg, dataset

"""`launcher=dry_run`: print the plan and where it was written; nothing runs."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hpc_rl.config.schema import RunConfig
from hpc_rl.models import families
from hpc_rl.plan.job_plan import JobPlan
from hpc_rl.plan.report import describe
from hpc_rl.durable import write_atomic
from hpc_rl.rundir import RunDir


class DryRunLauncher:
    name = "dry_run"
    # Nothing starts, so what only a running rank needs (run.program, models, data, the
    # settings this version cannot run) is listed, not refused: the flagship recipe plans
    # and renders although this version cannot run it.
    starts_ranks = False

    def preflight(self, cfg: RunConfig, plan: JobPlan) -> None:
        pass

    def launch(self, cfg: RunConfig, plan: JobPlan, run_dir: RunDir, overrides: Sequence[str] = ()) -> int:
        from hpc_rl.config.memory_fit import memory_misfits, render_misfits
        from hpc_rl.config.support import render_unsupported, unsupported

        print(describe(cfg, plan))
        fam = families.named(cfg.model.architecture)
        if fam is families.GENERIC:  # no family folder: what that path runs and refuses
            print(f"\nmodel: on the generic path (model.architecture={fam.name}): {fam.parallel_refusal}; "
                  "expert parallel needs an MoE family's expert layout; the refit hands vLLM's own loader whole "
                  "tensors in Hugging Face names")
        for listing in (render_unsupported(unsupported(cfg)), render_misfits(memory_misfits(cfg))):
            if listing:
                print("\n" + listing)
        print(f"\nrun directory: {run_dir.path}")
        print(f"  {run_dir.config}\n  {run_dir.plan}")
        if cfg.launcher.plan_out:
            out = Path(cfg.launcher.plan_out)
            out.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(out, plan.to_json())
            print(f"  {out}")
        print("dry run: nothing was submitted (launcher=slurm submits this plan)")
        return 0

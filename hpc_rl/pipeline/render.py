"""Hand submission and the plan file of a pipeline.

`render_files` gives every stage's het-job script (slurm/sbatch.py, rendered without a run
directory: it plans its run on first start, checked as launcher=slurm checks) and a
submit.sh that submits them in DAG order, each with --dependency=afterok on its upstream
jobs and the run directory <pipeline dir>/<stage> (HPC_RL_RUN_DIR, which the scripts read).
Stage references are resolved to the producers' export paths in the scripts' replayed
overrides, so a script needs no pipeline machinery at run time.

`plan_doc` is the golden plan: each stage's nodes and every role's parallel layout.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Dict, List

from hpc_rl.rundir import DEFAULT_DIR_MODE, umask_for
from hpc_rl.runtime import env

from .compose import StageCheck, check_all, compose_stage, export_path, resolved_overrides
from .spec import CommandLine, PipelineSpec
from .submit import layout

SUBMIT_SCRIPT = "submit.sh"


def _script_overrides(check: StageCheck, pdir: Path) -> List[str]:
    # run.dir comes from submit.sh (HPC_RL_RUN_DIR); the script's bootstrap sets it itself
    return [o for o in resolved_overrides(check.overrides, pdir) if not o.startswith("run.dir=")]


def stage_script(check: StageCheck, pdir: Path) -> str:
    from hpc_rl.slurm.sbatch import RenderOptions, render

    overrides = _script_overrides(check, pdir)
    cfg = compose_stage(check.overrides, lambda ref: str(export_path(pdir, ref)))
    assert check.plan is not None
    return render(cfg, check.plan, RenderOptions(run_dir=None, overrides=tuple(overrides)))


def submit_script(spec: PipelineSpec, pdir: Path) -> str:
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# The {spec.name} pipeline, submitted by hand: every stage's script in this directory, chained",
        "# with Slurm dependencies; a stage whose upstream fails is cancelled by Slurm (--kill-on-invalid-dep).",
        f"# Rendered by `python -m hpc_rl.pipeline render {spec.name}`; `python -m hpc_rl.launch +pipeline={spec.name}",
        "# launcher=slurm` does the same and records pipeline.json for `python -m hpc_rl.pipeline status DIR`.",
        "set -euo pipefail",
        f"umask {umask_for(DEFAULT_DIR_MODE):04o}  # the stages' run directories; each stage's script sets its run.dir_mode",
        'here=$(cd "$(dirname "$0")" && pwd)',
        f"PIPELINE_DIR={q(str(pdir))}",
        "submit() {  # submit <stage> [job ids it waits for...]: prints the job id",
        "    local stage=$1; shift",
        "    local dep=()",
        '    if [ $# -gt 0 ]; then dep=(--dependency="afterok:$(IFS=:; echo "$*")" --kill-on-invalid-dep=yes); fi',
        '    mkdir -p "$PIPELINE_DIR/$stage"',
        f'    {env.RUN_DIR}="$PIPELINE_DIR/$stage" sbatch --parsable "${{dep[@]}}" "$here/$stage.sbatch" | cut -d";" -f1',
        "}",
    ]
    for name in spec.order():
        ups = " ".join(f'"${u}"' for u in spec.stages[name].deps())
        lines.append(f"{name}=$(submit {name}{' ' + ups if ups else ''})")
        lines.append(f'echo "{name}: job ${name}"')
    lines.append('echo "pipeline directory: $PIPELINE_DIR"')
    return "\n".join(lines) + "\n"


def render_files(spec: PipelineSpec, cli: CommandLine, pdir: Path) -> Dict[str, str]:
    checks = check_all(spec, cli, pdir, launcher_checks=False)
    files = {f"{c.name}.sbatch": stage_script(c, pdir) for c in checks}
    files[SUBMIT_SCRIPT] = submit_script(spec, pdir)
    return files


def plan_doc(spec: PipelineSpec, checks: List[StageCheck]) -> str:
    stages = {}
    for c in checks:
        assert c.plan is not None and c.cfg is not None
        stages[c.name] = {"recipe": spec.stages[c.name].recipe, "after": spec.stages[c.name].deps(),
                          "inputs": c.inputs, "nodes": c.plan.total_nodes, "gpus": c.plan.total_gpus,
                          "max_seq_len": c.cfg.trainer.max_seq_len, "roles": layout(c)}
    return json.dumps({"pipeline": spec.name, "cluster": checks[0].cfg.cluster.name if checks and checks[0].cfg else None,
                       "order": spec.order(), "stages": stages}, indent=2) + "\n"


def plan_table(spec: PipelineSpec, checks: List[StageCheck]) -> str:
    """One line per stage: nodes, and each role's nodes and parallel layout."""
    lines = [f"  {'stage':<18}{'after':<28}{'nodes':>6}  roles"]
    for c in checks:
        assert c.plan is not None
        roles = "; ".join(f"{r.name} {r.nodes}" + (f" (tp{r.parallel['tp']} cp{r.parallel['cp']} ep{r.parallel['ep']} "
                                                   f"pp{r.parallel['pp']} dp{r.parallel['dp']})" if r.gpus_per_node else "")
                          for r in c.plan.roles)
        lines.append(f"  {c.name:<18}{(', '.join(spec.stages[c.name].deps()) or '-')[:27]:<28}{c.plan.total_nodes:>6}  {roles}")
    return "\n".join(lines)


def write_files(files: Dict[str, str], out_dir: Path) -> List[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in files.items():
        p = out_dir / name
        p.write_text(text)
        if name == SUBMIT_SCRIPT:
            p.chmod(0o755)
        paths.append(p)
    return paths

"""Golden files of the shipped recipes, plans (tests/golden/) and het sbatch scripts
(sbatch/, which users may submit by hand): tests compare, `--write` regenerates.

    python tests/golden.py --write      (or: make golden)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
SBATCH_DIR = Path(__file__).resolve().parents[1] / "sbatch"

# (recipe, cluster): the plans users read before spending 224 nodes on them.
PLAN_CASES = [("ultra_mopd", "gb200_nvl72"), ("ultra_mopd", "h100")]


# (recipe, cluster, container overrides or ()): the shipped scripts
CONTAINER = ("container.image=/lustre/images/hpc_rl.sqsh", "container.mounts=[/lustre:/lustre]")
SBATCH_CASES = [(r, c, ct) for r, c in PLAN_CASES for ct in ((), CONTAINER)]


def sbatch_path(recipe: str, cluster: str, container: tuple) -> Path:
    return SBATCH_DIR / f"{recipe}.{cluster}{'.container' if container else ''}.sbatch"


def render_sbatch(recipe: str, cluster: str, container: tuple) -> str:
    from hpc_rl.config import load_config
    from hpc_rl.plan import build_plan
    from hpc_rl.slurm.sbatch import RenderOptions, render

    overrides = (f"+recipe={recipe}", f"cluster={cluster}", *container)
    cfg = load_config(list(overrides))
    return render(cfg, build_plan(cfg), RenderOptions(run_dir=None, overrides=overrides))


def plan_path(recipe: str, cluster: str) -> Path:
    return GOLDEN_DIR / f"{recipe}.{cluster}.plan.json"


def render_plan(recipe: str, cluster: str) -> str:
    from hpc_rl.config import load_config
    from hpc_rl.plan import build_plan

    return build_plan(load_config([f"+recipe={recipe}", f"cluster={cluster}"])).to_json()


# The pipelines whose stage scripts (sbatch/<dir>/) and plan (each stage's nodes and parallel
# layout) ship: (pipeline, cluster, directory under sbatch/).
PIPELINE_CASES = [("ultra", "gb200_nvl72", "ultra_pipeline")]


def pipeline_plan_path(pipeline: str, cluster: str) -> Path:
    return GOLDEN_DIR / f"{pipeline}_pipeline.{cluster}.plan.json"


def render_pipeline(pipeline: str, cluster: str, out_dir: str) -> Dict[Path, str]:
    from hpc_rl.pipeline.compose import check_all
    from hpc_rl.pipeline.render import plan_doc, render_files
    from hpc_rl.pipeline.spec import load_spec, split_args

    spec = load_spec(pipeline)
    cli = split_args([f"cluster={cluster}"])
    pdir = Path(spec.dir)
    out = {SBATCH_DIR / out_dir / name: text for name, text in render_files(spec, cli, pdir).items()}
    out[pipeline_plan_path(pipeline, cluster)] = plan_doc(spec, check_all(spec, cli, pdir, launcher_checks=False))
    return out


def rendered() -> Dict[Path, str]:
    out = {plan_path(r, c): render_plan(r, c) for r, c in PLAN_CASES}
    out.update({sbatch_path(r, c, ct): render_sbatch(r, c, ct) for r, c, ct in SBATCH_CASES})
    for case in PIPELINE_CASES:
        out.update(render_pipeline(*case))
    return out


def main(argv: List[str]) -> int:
    write = "--write" in argv
    stale = 0
    for path, text in rendered().items():
        same = path.exists() and path.read_text() == text
        if write and not same:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
        elif not same:
            stale += 1
            print(f"stale: {path}")
    return 1 if stale and not write else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main(sys.argv[1:]))

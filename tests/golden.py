"""Golden plan files of the shipped recipes: tests compare, `--write` regenerates.

    python tests/golden.py --write      (or: make golden)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"

# (recipe, cluster): the plans users read before spending 224 nodes on them.
PLAN_CASES = [("ultra_mopd", "gb200_nvl72"), ("ultra_mopd", "h100")]


def plan_path(recipe: str, cluster: str) -> Path:
    return GOLDEN_DIR / f"{recipe}.{cluster}.plan.json"


def render_plan(recipe: str, cluster: str) -> str:
    from hpc_rl.config import load_config
    from hpc_rl.plan import build_plan

    return build_plan(load_config([f"+recipe={recipe}", f"cluster={cluster}"])).to_json()


def rendered() -> Dict[Path, str]:
    return {plan_path(r, c): render_plan(r, c) for r, c in PLAN_CASES}


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

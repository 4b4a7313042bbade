"""A local package index for environment libraries in their jail (hpc_rl/envs/jail.py), which
has no network: a directory of wheels made into a PEP 503 "simple" index of file:// links, for
uv's `UV_DEFAULT_INDEX`. verifiers' harnesses prepare their programs with `uv sync --script`
(PEP 723 dependencies), which asks an index even when the wheels are at hand (uv 0.13 has no
environment variable for --no-index); pointed at this one, it installs offline.

    python -m hpc_rl.envs.wheel_index WHEELS_DIR INDEX_DIR   (`make verifiers-env` runs it)
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path


def project(wheel: str) -> str:
    """A distribution file's normalized project name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", wheel.split("-")[0]).lower()


def write_index(wheels: Path, index: Path) -> int:
    """index/<project>/index.html linking each of that project's files in `wheels`; returns the
    number of projects."""
    by_project: dict = {}
    for f in sorted(Path(wheels).resolve().iterdir()):
        if f.suffix in (".whl", ".gz", ".zip"):
            by_project.setdefault(project(f.name), []).append(f)
    index.mkdir(parents=True, exist_ok=True)
    for name, files in by_project.items():
        (index / name).mkdir(exist_ok=True)
        links = "".join(f'<a href="{html.escape(f.as_uri())}">{html.escape(f.name)}</a><br>\n' for f in files)
        (index / name / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    root = "".join(f'<a href="{n}/">{n}</a><br>\n' for n in sorted(by_project))
    (index / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{root}</body></html>\n")
    return len(by_project)


if __name__ == "__main__":
    print(f"{write_index(Path(sys.argv[1]), Path(sys.argv[2]))} projects indexed in {sys.argv[2]}")

"""Where the tiny test models live: the cache (`HPC_RL_ASSETS`, else ~/.cache/hpc_rl/assets),
the sets shipped in the repository (tiny_assets/), and the build that fills the cache once."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional


def default_root() -> Path:
    return Path(os.environ.get("HPC_RL_ASSETS", Path.home() / ".cache" / "hpc_rl" / "assets"))


@dataclass
class Assets:
    root: Path
    paths: Dict[str, Path] = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> Path:
        return self.paths[name]


# Sets the suite and the demo use, as this builder made them (tiny_assets/README.md): a fresh
# machine copies them instead of training them (minutes of CI); a spec whose key is not
# shipped is built as before.
SHIPPED = Path(__file__).resolve().parents[2] / "tiny_assets"


def cached_build(spec, root: Optional[Path], build: Callable[[Path], dict]) -> Assets:
    """The assets of `spec` from the cache, else copied from the repository's shipped sets,
    else built by `build(tmp) -> manifest`; into a temporary directory renamed into place when
    complete (a failed build leaves nothing)."""
    root = Path(root or default_root())
    final = root / f"tiny-{spec.key()}"
    if not (final / "manifest.json").exists():
        tmp = root / f".tiny-{spec.key()}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shipped = SHIPPED / final.name
        try:
            if (shipped / "manifest.json").exists():
                shutil.copytree(shipped, tmp)
                manifest = json.loads((tmp / "manifest.json").read_text())
            else:
                manifest = build(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        root.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished first: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    manifest = json.loads((final / "manifest.json").read_text())
    return Assets(final, {name: final / name for name in manifest["models"]}, manifest)

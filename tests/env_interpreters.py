"""TEST-ONLY. The interpreters of the adapted environment libraries' tests: verifiers'
virtualenv (.venv-verifiers) and NeMo Gym's Python 3.13 root (.gym-python), both made by
`make env-interpreters` (the Makefile says what each is).

`make test` builds them beside the suite rather than before it (issue #30): the build is
two processes waiting mostly on pip, debootstrap and dpkg (about 3 minutes here with warm
caches, about 7 on a fresh machine), so the suite's other tests run meanwhile and the tests
that use them (the `env_interpreters_ready` fixture) go last, just before the `after_runs` ones.
With HPC_RL_ENV_INTERPRETERS=background (the Makefile's test target sets it) the build
starts when pytest starts; without it, the first test that needs the interpreters builds
them then (a no-op when they are current: make's stamps).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
LOG = REPO / ".env-interpreters.log"  # git-ignored
ENV = "HPC_RL_ENV_INTERPRETERS"
FIXTURE = "env_interpreters_ready"  # tests/conftest.py
# a fresh machine's build took about 7 minutes; a loaded one may take twice that
TIMEOUT_S = 1800

_build: Optional[subprocess.Popen] = None


def _command() -> list:
    return ["make", "--no-print-directory", "env-interpreters", f"PY={sys.executable}"]


def start_in_background() -> None:
    """Start the build when the run asked for it (pytest_configure); its output goes to LOG."""
    global _build
    if os.environ.get(ENV) != "background" or _build is not None:
        return
    with LOG.open("w") as log:
        _build = subprocess.Popen(_command(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _failed(rc: int) -> str:
    tail = LOG.read_text()[-4000:] if LOG.exists() else ""
    return f"`make env-interpreters` exited {rc} (its output: {LOG}):\n{tail}"


def ready() -> None:
    """The interpreters exist: wait for the background build, or build them now."""
    t0 = time.monotonic()
    if _build is not None:
        rc = _build.wait(timeout=TIMEOUT_S)
    else:
        with LOG.open("w") as log:
            rc = subprocess.run(_command(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=TIMEOUT_S).returncode
    if rc != 0:
        raise RuntimeError(_failed(rc))
    waited = time.monotonic() - t0
    if waited > 1:
        print(f"env interpreters ready after {waited:.0f} s more", file=sys.stderr)


def finish() -> None:
    """At the end of the run (pytest_unconfigure): a build no test waited for (a filtered
    run) still ends whole, so that a debootstrap or pip install is not cut halfway."""
    if _build is not None and _build.poll() is None:
        _build.wait(timeout=TIMEOUT_S)


def order_key(item) -> int:
    """Collection order: every other test, then the ones that need the interpreters (the
    build overlaps the rest), then `after_runs` (they read what all of those left)."""
    if item.get_closest_marker("after_runs") is not None:
        return 2
    return 1 if FIXTURE in getattr(item, "fixturenames", ()) else 0

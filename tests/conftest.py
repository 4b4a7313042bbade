"""Shared pytest fixtures.

`local_slurm` brings up the six-node localhost Slurm cluster from
`launchers/local_slurm.sh` once per session and leaves it running afterwards, so the
next test run finds it up and pays ~0.1 s instead of a cold start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import env_interpreters
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Tests that host their own store or exchange messages outside a launch (no launcher made a
# job key) sign with one made for this session; spawned ranks and vLLM workers inherit it.
# Launches make their own (hpc_rl/runtime/signed_store.py).
from hpc_rl.runtime.signed_store import ensure_job_key  # noqa: E402

ensure_job_key()
LOCAL_SLURM_SH = REPO_ROOT / "launchers" / "local_slurm.sh"

# Cold start is a few seconds; a fresh CI machine may also apt-get install Slurm first.
_UP_TIMEOUT_S = 600


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml declares these too; registering them here keeps `--strict-markers`
    # happy even when this conftest is used on its own.
    config.addinivalue_line("markers", "slurm: needs the local Slurm cluster (tests/conftest.py::local_slurm)")
    config.addinivalue_line("markers", "gpu: needs a real CUDA GPU")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line("markers", "after_runs: runs after every other test (reads what their real runs left)")
    env_interpreters.start_in_background()


def pytest_unconfigure(config: pytest.Config) -> None:
    env_interpreters.finish()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    # tests/test_config_keys.py joins the config keys that the session's real runs read
    # (config_reads/*.json under the session's temp dir): it must come after those runs. The
    # tests that need the environment libraries' interpreters come just before, so that their
    # build overlaps the rest (tests/env_interpreters.py). A stable sort keeps every other
    # order as collected.
    items.sort(key=env_interpreters.order_key)


@dataclass(frozen=True)
class LocalSlurm:
    """What tests need to know about the running local cluster."""

    partition: str
    nodes: tuple[str, ...]
    gpus_per_node: int
    state_dir: Path
    slurm_conf: Path

    def env(self, **extra: str) -> dict[str, str]:
        """os.environ with SLURM_CONF pointing at this cluster (plus `extra`)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.slurm_conf)
        env.update(extra)
        return env


def _require_slurm() -> bool:
    return os.environ.get("HPC_RL_REQUIRE_SLURM") == "1"


@pytest.fixture(scope="session")
def local_slurm() -> LocalSlurm:
    """Start (or reuse) the local cluster. Never torn down: see module docstring.

    Without `sbatch` on PATH the tests are skipped, unless HPC_RL_REQUIRE_SLURM=1 (CI),
    where `up` is run anyway -- it installs Slurm on a fresh machine -- and any failure
    fails the test instead of skipping it.
    """
    if shutil.which("sbatch") is None and not _require_slurm():
        pytest.skip("Slurm is not installed (no `sbatch` on PATH); run "
                    "`launchers/local_slurm.sh up` or set HPC_RL_REQUIRE_SLURM=1")

    state_dir = Path(os.environ.get("HPC_RL_SLURM_STATE", "/tmp/hpc_rl_slurm"))
    try:
        proc = subprocess.run(
            ["bash", str(LOCAL_SLURM_SH), "up"],
            capture_output=True, text=True, timeout=_UP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"`local_slurm.sh up` did not finish within {_UP_TIMEOUT_S}s: {exc}")
    except OSError as exc:  # no bash, unreadable script, ...
        pytest.fail(f"could not run `local_slurm.sh up`: {exc}")
    if proc.returncode != 0:
        msg = (f"`local_slurm.sh up` failed (rc={proc.returncode})\n"
               f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        # Slurm is installed (or required) but the cluster won't start: a bug, not a skip.
        pytest.fail(msg)
    if shutil.which("sbatch") is None:
        pytest.fail("`local_slurm.sh up` succeeded but `sbatch` is still not on PATH")

    return LocalSlurm(
        partition="local",
        nodes=tuple(f"node{k}" for k in range(1, 7)),
        gpus_per_node=4,
        state_dir=state_dir,
        slurm_conf=state_dir / "slurm.conf",
    )



@pytest.fixture(scope="session")
def env_interpreters_ready() -> None:
    """.venv-verifiers and .gym-python exist (tests/env_interpreters.py)."""
    env_interpreters.ready()


@pytest.fixture(scope="session")
def tiny_mopd_three_steps(tmp_path_factory):
    """The suite's shared local tiny_mopd run (tests/shared_runs.py): (run_dir, process)."""
    from shared_runs import launch_tiny_mopd_three_steps

    return launch_tiny_mopd_three_steps(tmp_path_factory.mktemp("tiny_mopd") / "run")

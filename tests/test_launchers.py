"""Launchers behind one small interface, and the one failure-scoring table both supervisors
(the local launcher in Python, the rendered batch shell in bash) use."""

from __future__ import annotations

import subprocess
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

import hpc_rl.launchers
from hpc_rl.config.compose import available
from hpc_rl.config.schema import LauncherConfig
from hpc_rl.ft import culprit
from hpc_rl.launchers.base import LAUNCHERS
from hpc_rl.launchers.local import Rank, culprit as local_culprit
from hpc_rl.rundir import RunDir
from hpc_rl.slurm.sbatch import _role_reports
from import_checks import imported_modules


def test_registry_schema_and_recipe_groups_name_the_same_launchers():
    literal = set(typing.get_args(typing.get_type_hints(LauncherConfig)["name"]))
    assert set(LAUNCHERS) == literal == set(available("launcher"))
    for name, launcher in LAUNCHERS.items():
        assert launcher.name == name and callable(launcher.launch) and callable(launcher.preflight)
    assert not LAUNCHERS["dry_run"].starts_ranks and LAUNCHERS["local"].starts_ranks and LAUNCHERS["slurm"].starts_ranks


def test_no_launcher_imports_the_cli():
    """launch.py imports the launchers; an import back (even inside a function) is a circle."""
    for path in Path(hpc_rl.launchers.__file__).parent.glob("*.py"):
        assert "hpc_rl.launch" not in imported_modules(path), f"{path.name} imports hpc_rl.launch"


# (exit status, error report) -> class; the order of RULES decides the overlaps
CASES = [
    (0, None, culprit.FINISHED),
    (137, "ConnectionResetError: Connection reset by peer", culprit.KILLED),  # killed first, report or not
    (-9, None, culprit.KILLED),  # Popen's view of SIGKILL
    (culprit.STOPPED_BY_PEER_EXIT, "RuntimeError: Connection closed by peer", culprit.STOPPED),
    (1, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:4242", culprit.LOST_PEER),
    (1, "BrokenPipeError: [Errno 32] Broken pipe", culprit.LOST_PEER),
    (1, "RuntimeError: injected failure on generator:0", culprit.RAISED),
    (1, None, culprit.RAISED),
]


@pytest.mark.parametrize("rc,report,expected", CASES)
def test_python_classes(rc, report, expected):
    assert culprit.classify(rc, lambda: report) == expected


def test_the_rendered_bash_scores_like_python(tmp_path):
    """The batch shell's score_of (rendered from the table) against culprit.score, case by case."""
    rd = RunDir(tmp_path)
    rd.errors.mkdir()
    roles, rcs = [], []
    for k, (rc, report, _) in enumerate(CASES):
        if rc < 0:
            continue  # bash sees 128 + signal, never a negative status
        role = f"teacher/r{k}"
        roles.append(role)
        rcs.append(rc)
        if report:
            rd.error_report(role, 0, 5).write_text(f"{role}:0: {report}\n")
    script = "\n".join([f"roles=({' '.join(roles)})", f"rcs=({' '.join(map(str, rcs))})",
                        *culprit.render_bash(_role_reports),
                        'for i in "${!roles[@]}"; do score_of "$i"; done'])
    out = subprocess.run(["bash", "-c", script], env={"RUN_DIR": str(tmp_path), "HPC_RL_RESTART": "5",
                                                       "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout.split()
    expected = [culprit.score(rc, lambda r=report: r) for rc, report, _ in CASES if rc >= 0]
    assert [int(x) for x in out] == expected


def test_the_local_launcher_blames_the_rank_that_raised_over_one_that_lost_it(tmp_path):
    """trainer:0 comes first in rank order and lost its connection; generator:0 raised the real
    error. With three levels (no lost-peer class) both scored alike and trainer:0 was named."""
    rd = RunDir(tmp_path)
    rd.errors.mkdir()
    rd.error_report("trainer", 0, 0).write_text("trainer:0: RuntimeError: Connection closed by peer\n")
    rd.error_report("generator", 0, 0).write_text("generator:0: RuntimeError: injected failure\n")

    def rank(role, component, rc):
        return Rank(role, component, 0, SimpleNamespace(returncode=rc), [])

    bad = [rank("trainer", 0, 1), rank("generator", 1, 1), rank("env", 3, culprit.STOPPED_BY_PEER_EXIT)]
    assert local_culprit(bad, tmp_path).role == "generator"
    assert local_culprit([*bad, rank("teacher/math", 2, 137)], tmp_path).role == "teacher/math"  # killed wins


def test_a_heartbeat_verdict_names_the_culprit_even_while_it_still_runs(tmp_path):
    """generator:0 froze: the heartbeats name it while it still runs; trainer:0 exited 75 and
    env:0 raised 'connection closed'. The batch shell names the verdict's role; so must the
    local launcher (it used to name env:0 or trainer:0, depending on who exited first)."""
    rd = RunDir(tmp_path)
    rd.errors.mkdir()
    rd.dead_rank(0).write_text("generator:0 missed heartbeats for 4.0s (ft.heartbeat_timeout_s=4); last seen in ?\n")
    rd.error_report("env", 0, 0).write_text("env:0: RuntimeError: Connection closed by peer\n")

    def rank(role, component, rc):
        return Rank(role, component, 0, SimpleNamespace(returncode=rc, poll=lambda: rc), [])

    frozen = rank("generator", 1, None)
    bad = [rank("trainer", 0, culprit.STOPPED_BY_PEER_EXIT), rank("env", 3, 1)]
    assert local_culprit(bad, tmp_path, [bad[0], frozen, bad[1]]) is frozen
    assert culprit.named_in_verdict("teacher/math:3 stopped beating (killed or hung)") == ("teacher/math", 3)
    assert culprit.named_in_verdict("rank 7 stopped beating") is None

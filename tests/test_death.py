"""A rank killed by a signal is named by its signal, and an OOM kill by the kernel's word
(runtime/death.py, through the rank supervisor of runtime/supervise.py). The children are
real processes killed for real; the OOM kill runs inside a memory cgroup made for the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rl.rundir import RunDir
from hpc_rl.runtime.death import describe_status, explain, signal_of
from hpc_rl.runtime.env import RankEnv

# The rank the supervisor runs: kills itself with the signal given, allocates N MiB, or waits.
CHILD = """
import os, signal, sys, time
how = sys.argv[2]
if how == "alloc":
    hog = b"x" * (int(sys.argv[3]) << 20)  # written, so every page is charged to the cgroup
    time.sleep(5)
elif how == "wait":
    time.sleep(60)
else:
    os.kill(os.getpid(), int(how))
"""
SUPERVISOR = "import sys; from hpc_rl.runtime.supervise import supervise; " \
             "sys.exit(supervise('death_child', sys.argv[1:], run_dir=sys.argv[1]))"


def _supervised(tmp_path: Path, *args: str, cgroup_procs: Path = None) -> subprocess.Popen:
    (tmp_path / "death_child.py").write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()]),
               **RankEnv(run_dir=str(tmp_path / "run"), role="trainer", role_rank=0, restart=0).to_env())

    def join():  # in the supervisor before exec: it and its child are charged to the cgroup
        if cgroup_procs is not None:
            cgroup_procs.write_text("0")
    return subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path / "run"), *args], env=env,
                            stderr=subprocess.PIPE, text=True, preexec_fn=join, start_new_session=True)


def _report(tmp_path: Path) -> str:
    path = RunDir(tmp_path / "run").error_report("trainer", 0, 0)
    return path.read_text() if path.exists() else ""


def test_exit_statuses_are_worded_by_signal():
    assert signal_of(-9) == 9 and signal_of(137) == 9 and signal_of(1) is None and signal_of(0) is None
    assert describe_status(137) == "was killed by SIGKILL (signal 9)"
    assert describe_status(-15) == "was killed by SIGTERM (signal 15)"
    assert describe_status(1) == "exited 1"
    assert explain(143) == "was killed by SIGTERM (signal 15)"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_child_killed_by_a_signal_is_named_by_it(tmp_path, sig):
    proc = _supervised(tmp_path, str(int(sig)))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig
    name = f"was killed by {sig.name} (signal {int(sig)})"
    assert f"hpc_rl: trainer:0 {name}" in err
    report = _report(tmp_path)
    assert report.startswith(f"trainer:0: {name}"), report
    if sig == signal.SIGKILL:  # nothing here named an OOM kill: it says SIGKILL came from outside
        assert "from outside" in report and "OOM killer, the scheduler or a person" in report


def test_a_stop_the_supervisor_forwarded_leaves_no_report(tmp_path):
    """SIGTERM sent to the supervisor (a launcher or Slurm stopping the job) is a stop its
    sender knows of: an error report would hide the heartbeats' verdict on the real culprit."""
    proc = _supervised(tmp_path, "wait")
    time.sleep(2.0)  # the child is running
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "was killed by SIGTERM" in err
    assert _report(tmp_path) == ""


def _memory_cgroup(name: str) -> Path:
    """A fresh v1 memory cgroup under this process's, or skip: this needs root and cgroup v1
    (the project's own sandboxes make theirs the same way: envs/sandbox_cgroup.py)."""
    own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if "memory" in line.split(":", 2)[1].split(",")), None)
    if own is None:
        pytest.skip("no cgroup v1 memory hierarchy here")
    d = Path("/sys/fs/cgroup/memory") / own.lstrip("/") / name
    try:
        d.mkdir()
        (d / "memory.limit_in_bytes").write_text(str(96 << 20))
        if (d / "memory.memsw.limit_in_bytes").exists():  # no swap to escape to
            (d / "memory.memsw.limit_in_bytes").write_text(str(96 << 20))
    except OSError as exc:
        if d.exists():
            d.rmdir()
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    return d


def test_a_child_killed_by_the_oom_killer_is_named_so_with_the_counter(tmp_path):
    cg = _memory_cgroup(f"hpc_rl_test_death_{os.getpid()}")
    try:
        proc = _supervised(tmp_path, "alloc", "400", cgroup_procs=cg / "cgroup.procs")
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGKILL, err
        report = _report(tmp_path)
        assert report.startswith("trainer:0: was killed by the kernel's OOM killer (SIGKILL, signal 9; "), report
        assert "memory.oom_control oom_kill 0 -> 1" in report, report
        assert "trainer.micro_batch_size" in report and "more nodes" in report  # the fix
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_the_kernel_log_names_the_oom_kill_when_no_counter_does(monkeypatch):
    """A node-wide OOM kill (no cgroup limit reached, or a cgroup the rank cannot read): the
    kernel log's line on the pid is the evidence; another pid's line is not."""
    import hpc_rl.runtime.death as death

    log = ("[ 1.0] Out of memory: Killed process 4242 (python) total-vm:9000kB, anon-rss:8000kB, file-rss:0kB\n"
           "[ 2.0] Out of memory: Killed process 77 (python) total-vm:1kB, anon-rss:1kB, file-rss:0kB\n")
    monkeypatch.setattr(death.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, log, ""))
    said = explain(-9, 4242)
    assert said.startswith("was killed by the kernel's OOM killer (SIGKILL, signal 9; kernel log: "
                           "Killed process 4242 (python) total-vm:9000kB, anon-rss:8000kB)"), said
    assert "from outside" in explain(-9, 4343)

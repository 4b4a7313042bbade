"""Sandboxed tools (hpc_rl/envs/sandbox.py): isolation, limits, and that nothing outlives its
caller. Needs bubblewrap (`make setup` installs it) and user namespaces; no Slurm, no model.

Waits are on events (a line from a pipe, a process appearing in /proc) with generous
deadlines, never fixed sleeps.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from hpc_rl.envs.sandbox import Limits, Sandbox, SandboxUnavailable, find_sandbox_processes, reap_leftovers
from hpc_rl.envs.seccomp import filter_program

REPO_ROOT = Path(__file__).resolve().parents[1]
# The interpreter a tool call would get from the sandbox's PATH. As root the sandbox runs as
# nobody, who cannot reach a Python installed under /root (this machine's pyenv).
TOOL_PY = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable


def _tag() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def _until(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout} s: {what}")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _sleeping_tool(tag: str):
    """The marked processes once the tool (a `sleep`) runs among them."""
    pids = find_sandbox_processes(tag)
    return pids if any(_comm(p) == "sleep" for p in pids) else None


@pytest.fixture
def sandbox():
    sb = Sandbox(_tag(), Limits(wall_s=20.0, cpu_s=20))
    yield sb
    reap_leftovers(sb.tag)  # only matters when a test failed half-way


def test_no_network(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # reachable from outside
        listener.accept()[0].close()
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5); print('CONNECTED')"
    res = sandbox.run([TOOL_PY, "-c", code])
    listener_got = True
    try:
        listener.accept()
    except BlockingIOError:
        listener_got = False
    listener.close()
    assert res.exit_code != 0 and "CONNECTED" not in res.stdout, res
    assert "ConnectionRefused" in res.stderr or "unreachable" in res.stderr, res.stderr
    assert not listener_got


def test_no_unix_socket_to_host_services(sandbox):
    # A path socket anyone may connect to, on the read-only root: the seccomp filter refuses.
    d = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        d.chmod(0o777)
        path = d / "service.sock"
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(str(path))
        path.chmod(0o777)
        srv.listen()
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(path))  # reachable from outside
        code = f"import socket; c = socket.socket(socket.AF_UNIX); c.connect({str(path)!r}); print('CONNECTED')"
        res = sandbox.run([TOOL_PY, "-c", code])
        srv.close()
        assert res.exit_code != 0 and "CONNECTED" not in res.stdout, res
        assert "PermissionError" in res.stderr, res.stderr
    finally:
        shutil.rmtree(d)


def test_no_io_uring_and_no_nested_user_namespaces(sandbox):
    # io_uring could open and connect sockets past the filter; a nested user namespace would
    # give the tool capabilities (inside it) and the kernel's namespace code to attack.
    code = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); params = ctypes.create_string_buffer(120); "
            "print(libc.syscall(425, 8, params), os.strerror(ctypes.get_errno()))")  # io_uring_setup, x86_64 and aarch64
    res = sandbox.run([TOOL_PY, "-c", code])
    assert res.stdout.strip() == "-1 Function not implemented", res
    res = sandbox.run(["unshare", "--user", "true"])
    assert res.exit_code != 0, res


def test_writes_only_in_scratch(sandbox):
    world_writable = Path(tempfile.mkdtemp(dir="/var/tmp"))  # writable for anyone on the host
    world_writable.chmod(0o777)
    name = f"sandbox-probe-{uuid.uuid4().hex[:8]}"
    targets = [REPO_ROOT / name, world_writable / name, Path("/root") / name, Path("/dev/shm") / name]
    try:
        for target in targets:
            res = sandbox.run(["sh", "-c", f"echo x > {target}"])
            assert res.exit_code != 0, (target, res)
            assert not target.exists(), target
        # the host's /var/tmp is not in the sandbox's view at all (the system directories only)
        assert "nonexistent" in sandbox.run(["sh", "-c", f"echo x > {world_writable / name}"]).stderr
        res = sandbox.run(["sh", "-c", f"echo scratch-ok > /tmp/{name} && cat /tmp/{name}"])
        assert res.exit_code == 0 and res.stdout == "scratch-ok\n", res
        assert not (Path("/tmp") / name).exists()  # the sandbox's /tmp is its own
    finally:
        shutil.rmtree(world_writable)


def test_host_scratch_dir_is_the_sandbox_tmp():
    # Not under pytest's tmp_path: its parent (mode 700, root's) is closed to nobody.
    scratch = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        sb = Sandbox(_tag(), scratch_dir=str(scratch))
        res = sb.run(["sh", "-c", "echo kept > /tmp/out.txt"])
        assert res.exit_code == 0, res
        assert (scratch / "out.txt").read_text() == "kept\n"
    finally:
        shutil.rmtree(scratch)


def test_caller_environment_is_not_inherited(sandbox):
    assert os.environ.get("HPC_RL_JOB_KEY"), "tests/conftest.py sets the job's secret"
    res = sandbox.run(["env"])
    assert res.exit_code == 0, res
    assert "HPC_RL_JOB_KEY" not in res.stdout and os.environ["HPC_RL_JOB_KEY"] not in res.stdout


def test_wall_time_kills_the_tool_and_its_children(sandbox):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("res", sandbox.run(
        ["sh", "-c", "sleep 1000 & while :; do :; done"], limits=Limits(wall_s=2.0))))
    t.start()
    seen = _until(lambda: _sleeping_tool(sandbox.tag), 15, "the tool and its child running")
    assert len(seen) >= 4  # outer bwrap, the namespace's first process, sh, sleep
    t.join(timeout=30)
    res = out["res"]
    assert res.timed_out and res.killed_by == "wall_time", res
    assert find_sandbox_processes(sandbox.tag) == []  # run() returns with nothing left (seen's pids may be reused)


def test_output_is_capped(sandbox):
    res = sandbox.run(["sh", "-c", "head -c 1000000 /dev/zero | tr '\\0' x; echo done >&2"], limits=Limits(output_bytes=4096))
    assert res.exit_code == 0, res
    assert len(res.stdout) == 4096 and set(res.stdout) == {"x"} and res.stdout_truncated
    assert res.stderr == "done\n" and not res.stderr_truncated


def test_memory_limit_stops_a_big_allocation(sandbox):
    lim = Limits(memory_bytes=256 << 20)
    small = sandbox.run([TOOL_PY, "-c", "b = bytearray(16 << 20); print('ok')"], limits=lim)
    assert small.exit_code == 0 and small.stdout == "ok\n", small
    big = sandbox.run([TOOL_PY, "-c", "b = bytearray(512 << 20); print('ok')"], limits=lim)
    assert big.exit_code != 0 and "MemoryError" in big.stderr, big


def test_cpu_and_process_limits(sandbox):
    res = sandbox.run(["sh", "-c", "while :; do :; done"], limits=Limits(cpu_s=1, wall_s=20))
    assert res.killed_by == "SIGXCPU" and not res.timed_out, res
    res = sandbox.run(["sh", "-c", "for i in $(seq 30); do sleep 30 & done"], limits=Limits(nproc=8))
    assert "fork" in res.stderr.lower(), res  # dash: "Cannot fork"


STAND_IN_RANK = """
import sys
from hpc_rl.envs.sandbox import Sandbox
Sandbox(sys.argv[1]).run(["sleep", "1000"], on_start=lambda pid: print(pid, flush=True))
"""


def test_sigkill_of_the_caller_mid_tool_call_leaves_no_sandbox():
    tag = _tag()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    rank = subprocess.Popen([sys.executable, "-c", STAND_IN_RANK, tag], stdout=subprocess.PIPE, env=env)
    try:
        ready, _, _ = select.select([rank.stdout], [], [], 30)
        assert ready, "the stand-in rank did not start its tool"
        outer = int(rank.stdout.readline())
        seen = _until(lambda: _sleeping_tool(tag), 15, "the tool running")
        assert outer in seen and len(seen) >= 3, seen  # outer bwrap, the namespace's first process, sleep
        rank.send_signal(signal.SIGKILL)
        rank.wait(timeout=10)
        _until(lambda: find_sandbox_processes(tag) == [], 10, f"sandbox processes gone (left: {find_sandbox_processes(tag)})")
        # its cgroup outlives it (no caller to remove it) until the rank's next incarnation reaps
        from hpc_rl.envs.sandbox_cgroup import placement

        parents = placement().parents
        assert len([d for p in parents for d in p.glob(tag + "_*")]) == len(parents)
        reap_leftovers(tag)
        assert not [d for p in parents for d in p.glob(tag + "_*")]
    finally:
        if rank.poll() is None:
            rank.kill()
        reap_leftovers(tag)


def _plant(sb: Sandbox, owner: str, cmd) -> subprocess.Popen:
    """A sandbox started without the parent-death signal, as if a previous rank left it."""
    prog = tempfile.TemporaryFile()
    prog.write(filter_program())
    prog.seek(0)
    with prog:
        return subprocess.Popen(sb.argv(cmd, f"{sb.tag}:{owner}", prog.fileno(), sb.limits), pass_fds=(prog.fileno(),),
                                user=sb.run_as, group=sb.run_as, extra_groups=[] if sb.run_as is not None else None,
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_reap_leftovers_kills_what_a_previous_rank_left(sandbox):
    sandbox.check()
    old = _plant(sandbox, "999999999.0", ["sleep", "1000"])
    other = Sandbox(_tag())
    other.check()
    neighbour = _plant(other, "999999999.0", ["sleep", "1000"])  # another rank's: must survive
    try:
        _until(lambda: _sleeping_tool(sandbox.tag), 15, "the planted leftover running")
        _until(lambda: _sleeping_tool(other.tag), 15, "the neighbour's sandbox running")
        killed = reap_leftovers(sandbox.tag)
        assert old.pid in killed, killed
        assert old.wait(timeout=10) == -signal.SIGKILL
        _until(lambda: find_sandbox_processes(sandbox.tag) == [], 10, "the leftover's namespace gone")
        assert neighbour.poll() is None and _sleeping_tool(other.tag)
    finally:
        for p in (old, neighbour):
            p.kill()
            p.wait(timeout=10)
        reap_leftovers(other.tag)


def test_missing_bubblewrap_is_a_clear_error():
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        Sandbox(_tag(), bwrap="/nonexistent/bwrap").check()


def test_no_user_namespaces_is_a_clear_error():
    # A process that may not create user namespaces (an outer bwrap with --disable-userns, as
    # uid 1000 so no drop to nobody applies): the check says so instead of running unsandboxed.
    code = ("from hpc_rl.envs.sandbox import Sandbox, SandboxUnavailable\n"
            "try:\n    Sandbox('t.r0').check()\nexcept SandboxUnavailable as e:\n    print('UNAVAILABLE', e)\n")
    res = subprocess.run(["bwrap", "--unshare-user", "--uid", "1000", "--gid", "1000", "--disable-userns", "--ro-bind", "/", "/",
                          "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                          # the checkout again, in case it lives under /tmp (a clone there hid it: ModuleNotFoundError)
                          "--ro-bind", str(REPO_ROOT), str(REPO_ROOT), "--setenv", "PYTHONPATH", str(REPO_ROOT),
                          "--", sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "UNAVAILABLE" in res.stdout and "user namespaces" in res.stdout, (res.stdout, res.stderr)


def test_the_sandbox_sees_no_home_run_directory_data_or_secret():
    """A tool runs tests/attack_envs/attack_probe.py (copied into its scratch, as a model's code
    would write it) against a file in the user's home, a run directory in the repository with
    its config and data, the repository itself and a process holding the job's secret: every
    attempt fails. Before the sandbox's own system view (the host's / read-only) it read all
    three files."""
    import json

    home = Path(os.path.expanduser("~"))
    secret = home / f".hpc_rl_sandbox_secret_{uuid.uuid4().hex[:8]}"
    run = REPO_ROOT / "runs" / f"sandbox_attack_{uuid.uuid4().hex[:8]}"
    scratch = Path(tempfile.mkdtemp(dir="/var/tmp"))
    decoy = subprocess.Popen(["sleep", "600"], env=dict(os.environ, HPC_RL_JOB_KEY="f" * 64))
    try:
        secret.write_text("f" * 64)
        (run / "data").mkdir(parents=True)
        (run / "config.yaml").write_text("run: {}\n")
        (run / "data" / "train.jsonl").write_text('{"answer": "4"}\n')
        shutil.copy(REPO_ROOT / "tests" / "attack_envs" / "attack_probe.py", scratch / "probe.py")
        targets = {"read": [str(secret), str(run / "config.yaml"), str(run / "data" / "train.jsonl")],
                   "write": [str(REPO_ROOT), str(run)], "home": str(home)}
        res = Sandbox(_tag(), scratch_dir=str(scratch)).run([TOOL_PY, "/tmp/probe.py", json.dumps(targets)])
        assert res.exit_code == 0, res
        report = json.loads(res.stdout)
        leaks = [f"{k}: {v}" for k, v in report.items() if str(v).startswith("LEAK")]
        assert not leaks and len(report) >= 10, (leaks, report)
        assert not list(REPO_ROOT.glob("planted_by_environment_*")) and not list(run.glob("planted_by_environment_*"))
    finally:
        decoy.kill()
        decoy.wait()
        secret.unlink(missing_ok=True)
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


# a tool that forks 3 children holding 160 MiB each (touched, so resident): 480 MiB together,
# under each process's own address-space cap of 1 GiB
FORK_HOLDERS = """
import os, time
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        b = bytearray(160 << 20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
codes = [os.waitpid(k, 0)[1] for k in kids]
print(codes)
"""


def test_memory_limit_holds_for_the_whole_sandbox_where_a_cgroup_can_be_made():
    """Limits.memory_bytes caps the sandbox's processes together (its cgroup), not each one: three
    processes of 160 MiB under a 256 MiB limit cannot all live, while under 1 GiB they can. On a
    node where no cgroup can be made the result says so (limits_scope "process")."""
    from hpc_rl.envs.sandbox_cgroup import placement

    where = placement()
    if where.scope == "process":
        pytest.skip(f"no cgroup for sandboxes on this node: {where.why_not}")
    sb = Sandbox(_tag())
    roomy = sb.run([TOOL_PY, "-c", FORK_HOLDERS], limits=Limits(memory_bytes=1 << 30, wall_s=60, cpu_s=60))
    assert roomy.exit_code == 0 and roomy.stdout.strip() == "[0, 0, 0]", roomy
    assert roomy.limits_scope == where.scope and roomy.peak_memory_bytes >= 3 * (160 << 20), roomy
    tight = sb.run([TOOL_PY, "-c", FORK_HOLDERS], limits=Limits(memory_bytes=256 << 20, wall_s=60, cpu_s=60))
    assert tight.killed_by == "memory" or "9" in tight.stdout, tight  # SIGKILLed by the kernel's OOM killer
    assert tight.stdout.strip() != "[0, 0, 0]", tight
    assert not [d for p in where.parents for d in p.glob(sb.tag + "_*")], "a sandbox's cgroup was left behind"

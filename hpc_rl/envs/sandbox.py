"""Sandboxed code and shell tools: one command inside bubblewrap, with limits, and cleanup
that does not depend on the caller's teardown running.

What a sandboxed command gets (bwrap flags): new user, pid, network, ipc, uts and cgroup
namespaces (no network: only the namespace's own loopback); of the host's files only the
system directories a Python or a shell needs, read-only (jail.system_view: /usr and the /etc
files on an allow list; never the home, the run directory, the data or the checkpoints);
a fresh /dev and /proc; a private /tmp that is the only writable place (a size-capped tmpfs,
or a host scratch directory the caller owns); an empty /run (daemons' sockets); no
environment from the caller (the job's secret, HPC_RL_JOB_KEY, lives there) except what
`env` names; the seccomp filter of seccomp.py (no path unix sockets, no io_uring). A caller
running as root starts it as an unprivileged uid (nobody), so the sandbox holds no
capability outside its namespaces and RLIMIT_NPROC applies (root is exempt from it); the
tool's interpreter must then be one nobody can run (a Python under /root is not).

Limits: over the whole sandbox where the node lets the rank make cgroups (sandbox_cgroup.py:
cgroup v2, else v1; memory and process count of all its processes together, the kernel's OOM
killer inside the sandbox: killed_by "memory"; `SandboxResult.limits_scope` says which held),
and in every case rlimits, which need nothing delegated: CPU seconds (SIGXCPU), address space
(a per-process memory cap: an allocation past it fails), file size and no core files, set in the
child before bwrap starts; processes (RLIMIT_NPROC) set by util-linux's `prlimit` inside
the sandbox, where the count covers this sandbox's user namespace only (set outside, it
would count every sandbox of the uid on the node). A wall-time limit kills the whole
sandbox; stdout and stderr are read as they come and kept up to a byte cap each.

Why nothing is left behind, however the caller ends:
- the pid namespace: when its first process dies the kernel kills every process in it, so
  a tool's background children cannot outlive the sandbox;
- parent-death signals: bwrap's `--die-with-parent` has the kernel SIGKILL the outer bwrap
  when its parent (the environment rank) dies and the namespace's first process when the
  outer bwrap dies, so a SIGKILLed rank takes its sandboxes with it (tests/test_sandbox.py:
  without the flag they outlive it). The child also sets PR_SET_PDEATHSIG itself before
  exec, for the moment before bwrap does, and exits if the rank is already gone. The
  signal follows the *thread* that started the child: call `run` from a long-lived thread;
- every sandbox carries a marker (`HPC_RL_SANDBOX=<tag>:<owner pid>.<n>`, in bwrap's argv and
  the tool's environment), so a restarted rank with the same tag (job + rank) finds and kills
  what a previous incarnation left (`reap_leftovers`), and a wall-time kill is verified.

Used by the python_tool environment (hpc_rl/agentic/python_tool.py): its env rank's tool
calls, the episode's deadline plus a scoring buffer as `deadline`, `reap_leftovers` at the
rank's start, counts in the metrics. Apptainer and enroot command lines are rendered by
container_sandbox.py, not run. Not done yet: cpu.max (CPU time is the rlimit's, per
process); running Apptainer or enroot as the sandbox. bubblewrap 0.8 or newer
is required (tmpfs `--size`, `--disable-userns`): check `bwrap --version` on older
distributions.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import resource
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .jail import system_view
from .sandbox_cgroup import SandboxCgroup, join_in_child, placement, sweep
from .seccomp import filter_program

MARK = "HPC_RL_SANDBOX"
NOBODY = 65534
MIN_BWRAP = (0, 8, 0)
INSTALL_HINT = "install bubblewrap 0.8 or newer (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
USERNS_HINT = ("it needs unprivileged user namespaces: sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1 "
               "(older Debian), kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu 24.04); inside a container, one that "
               "allows creating namespaces")
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)  # bound here: the child between fork and exec only calls it
_calls = itertools.count()


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing, too old, or cannot create the namespaces: never run unsandboxed."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 30.0
    cpu_s: int = 30
    memory_bytes: int = 1 << 30  # address space, not resident memory
    nproc: int = 64
    file_bytes: int = 64 << 20
    scratch_bytes: int = 256 << 20  # the tmpfs /tmp (not with a host scratch_dir)
    output_bytes: int = 64 << 10  # each of stdout and stderr


@dataclass
class SandboxResult:
    exit_code: int  # as a shell reports it: 128 + signal for a command killed by one
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    wall_s: float
    killed_by: Optional[str]  # "wall_time", "memory" (the sandbox's cgroup limit), or the signal ("SIGXCPU", ...)
    limits_scope: str = "process"  # where memory and process limits held: "cgroup v2", "cgroup v1" or "process"
    peak_memory_bytes: Optional[int] = None  # the whole sandbox's, where a cgroup measured it


@dataclass
class Sandbox:
    """Runs commands sandboxed under `tag` (unique per job and rank, stable across its restarts)."""

    tag: str
    limits: Limits = field(default_factory=Limits)
    # a host directory bound at /tmp, kept across calls (every directory above it searchable by
    # the sandbox's uid); default a tmpfs of limits.scratch_bytes per call
    scratch_dir: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)
    bwrap: str = "bwrap"
    run_as: Optional[int] = None  # uid (and gid) to drop to before bwrap; default nobody when root, else none

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", self.tag):
            raise ValueError(f"sandbox tag {self.tag!r}: letters, digits and _.+- only (it is matched in /proc)")
        if self.run_as is None and os.geteuid() == 0:
            self.run_as = NOBODY
        if self.scratch_dir is not None and self.run_as is not None:  # the sandbox writes there as run_as
            os.chown(self.scratch_dir, self.run_as, self.run_as)
        self._checked = False

    def argv(self, cmd: Sequence[str], marker: str, seccomp_fd: int, limits: Limits) -> List[str]:
        scratch = ["--bind", self.scratch_dir, "/tmp"] if self.scratch_dir else ["--size", str(limits.scratch_bytes), "--tmpfs", "/tmp"]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               # one core per tool, and few malloc arenas: each reserves address space the cap counts
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", **self.env, MARK: marker}
        return [self.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session",
                # the system directories a Python or a shell needs, read-only; never the home, the run
                # directory, the data or the checkpoints (jail.system_view); the root's tmpfs read-only
                *system_view(), "--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc", "--tmpfs", "/run",
                *scratch, "--remount-ro", "/", "--chdir", "/tmp", "--seccomp", str(seccomp_fd), "--clearenv",
                *[a for k, v in env.items() for a in ("--setenv", k, v)],
                "--", "prlimit", f"--nproc={limits.nproc}", "--", *cmd]

    def check(self) -> float:
        """Start one sandbox that does nothing; raise SandboxUnavailable saying why and what to
        do. Returns the seconds it took. `run` calls it once."""
        path = shutil.which(self.bwrap)
        if path is None:
            raise SandboxUnavailable(f"no {self.bwrap!r} on PATH: {INSTALL_HINT}")
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        got = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
        if got is None or tuple(map(int, got.groups())) < MIN_BWRAP:
            raise SandboxUnavailable(f"{path} reports {out.strip()!r}: {INSTALL_HINT}")
        self.bwrap, self._checked = path, True
        res = self.run(["true"], limits=Limits(wall_s=30.0))
        if res.exit_code != 0:
            self._checked = False
            err = res.stderr.strip()[-500:]
            hint = USERNS_HINT if "namespace" in err or "uid map" in err else (
                "the sandbox's uid must be able to reach scratch_dir and util-linux's prlimit must be on PATH")
            raise SandboxUnavailable(f"{path} could not start a sandbox (exit {res.exit_code}: {err}); {hint}")
        return res.wall_s

    def run(self, cmd: Sequence[str], *, limits: Optional[Limits] = None, deadline: Optional[float] = None,
            on_start: Optional[Callable[[int], None]] = None) -> SandboxResult:
        """Run `cmd` (argv, e.g. ["python3", "-c", code] or ["sh", "-c", line]) in a new sandbox.
        `deadline` (time.monotonic()) ends it earlier than limits.wall_s, e.g. the episode's;
        `on_start(pid)` gets the outer bwrap's pid. The sandbox is gone when this returns."""
        if not self._checked:
            self.check()
        lim = limits or self.limits
        marker = f"{self.tag}:{os.getpid()}.{next(_calls)}"
        cg = SandboxCgroup(marker.replace(":", "_"), lim.memory_bytes, lim.nproc) if placement().parents else None
        try:
            return self._run(cmd, marker, lim, deadline, on_start, cg)
        finally:
            if cg is not None:
                cg.remove()

    def _run(self, cmd, marker, lim, deadline, on_start, cg) -> SandboxResult:
        with tempfile.TemporaryFile() as prog:  # bwrap reads the filter from an fd
            prog.write(filter_program())
            prog.seek(0)
            t0 = time.monotonic()
            end = t0 + lim.wall_s if deadline is None else min(t0 + lim.wall_s, deadline)
            proc = subprocess.Popen(
                self.argv(cmd, marker, prog.fileno(), lim), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(prog.fileno(),), env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                start_new_session=True,
                preexec_fn=_child_setup(lim, os.getpid(), cg.join_files if cg else [], self.run_as))
        try:
            if on_start is not None:
                on_start(proc.pid)
        except BaseException:
            _kill_group(proc.pid)
            proc.wait()
            raise
        out, err, timed_out = _collect(proc, end, lim.output_bytes)
        try:
            rc = proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:  # the tool closed its output but runs on
            timed_out = True
            _kill_group(proc.pid)
            rc = proc.wait()
        if timed_out:
            _wait_gone(marker, time.monotonic() + 10.0)
        rc = rc if rc >= 0 else 128 - rc
        killed_by = "wall_time" if timed_out else (_signal_name(rc - 128) if rc > 128 else None)
        if cg is not None and cg.oom_kills() and not timed_out:
            killed_by = "memory"  # the kernel killed a process of the sandbox at its cgroup's memory limit
        return SandboxResult(rc, out[0].decode(errors="replace"), err[0].decode(errors="replace"), out[1], err[1],
                             timed_out, time.monotonic() - t0, killed_by, cg.scope if cg else "process",
                             cg.peak_bytes() if cg else None)


def _child_setup(lim: Limits, parent: int, cgroups: List[bytes], run_as: Optional[int]) -> Callable[[], None]:
    """Runs in the child between fork and exec, after Popen's setsid: into the sandbox's cgroups
    while it may still write their files, then down to `run_as` (a credential change clears
    the parent-death signal, so that is set after), then the rlimits. Python warns that
    preexec_fn and threads mix badly (a lock held by another thread at fork stays held): this
    one only calls what was bound before the fork (libc's prctl, os and resource builtins),
    importing and allocating nothing of its own."""
    rlimits = [(resource.RLIMIT_CPU, lim.cpu_s, lim.cpu_s + 1), (resource.RLIMIT_AS, lim.memory_bytes, lim.memory_bytes),
               (resource.RLIMIT_FSIZE, lim.file_bytes, lim.file_bytes), (resource.RLIMIT_CORE, 0, 0)]

    def setup() -> None:
        join_in_child(cgroups)
        if run_as is not None:
            os.setgroups([])
            os.setgid(run_as)
            os.setuid(run_as)
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the caller died before the line above: nobody would kill us
            os._exit(137)
        for which, soft, hard in rlimits:
            resource.setrlimit(which, (soft, hard))

    return setup


def _collect(proc: subprocess.Popen, end: float, cap: int):
    """Read stdout and stderr until both close, keeping `cap` bytes of each and dropping the
    rest (the tool is not blocked on a full pipe); on `end` kill the sandbox and read on
    briefly. Returns (stdout, truncated), (stderr, truncated), timed_out."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    cut = {proc.stdout: False, proc.stderr: False}
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    timed_out = False
    while sel.get_map():
        left = end - time.monotonic()
        if left <= 0:
            if timed_out:  # killed, yet something holds the pipes: give up on them
                break
            timed_out = True
            _kill_group(proc.pid)
            end = time.monotonic() + 5.0
            continue
        for key, _ in sel.select(left):
            chunk = os.read(key.fd, 1 << 16)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.fileobj]
            room = cap - len(buf)
            buf += chunk[:max(room, 0)]
            cut[key.fileobj] |= len(chunk) > room
    sel.close()
    for f in bufs:
        f.close()
    return (bytes(bufs[proc.stdout]), cut[proc.stdout]), (bytes(bufs[proc.stderr]), cut[proc.stderr]), timed_out


def _kill_group(pgid: int) -> None:
    # The outer bwrap leads its own session; its death sends the namespace's first process
    # SIGKILL (--die-with-parent), whose death ends the whole pid namespace.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _signal_name(num: int) -> Optional[str]:
    try:
        return signal.Signals(num).name
    except ValueError:
        return None


def find_sandbox_processes(tag: str) -> List[int]:
    """PIDs of processes marked as sandboxes of `tag` (any owner), from /proc: the bwrap
    processes by their argv, the tools by their environment."""
    return [pid for pid, _ in _marked(tag)]


def _marked(tag: str):
    """(pid, owner) of each process marked for `tag`."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            owner = _marker_of(d, tag)
            if owner is not None:
                yield int(d.name), owner


def _marker_of(proc_dir: Path, tag: str) -> Optional[str]:
    """The owner part of the marker `proc_dir`'s process carries for `tag`, else None."""
    try:
        for name, mark in (("cmdline", f"\0{MARK}\0{tag}:"), ("environ", f"\0{MARK}={tag}:")):
            data = b"\0" + (proc_dir / name).read_bytes()
            hit = data.find(mark.encode())
            if hit >= 0:
                return data[hit + len(mark):].split(b"\0", 1)[0].decode(errors="replace")
    except OSError:  # gone meanwhile, or not ours to read
        pass
    return None


def reap_leftovers(tag: str) -> List[int]:
    """SIGKILL the sandboxes of `tag` that another process (a previous incarnation of this
    rank) started; call it when a rank starts. Returns the PIDs it killed. Markers whose owner
    pid is this process's are taken as its own and spared."""
    me = str(os.getpid())
    killed = []
    for pid, owner in list(_marked(tag)):
        if owner.split(".", 1)[0] == me:  # this incarnation's own
            continue
        try:
            fd = os.pidfd_open(pid)  # pins the process: a reused pid cannot be hit
        except OSError:
            continue
        try:
            if _marker_of(Path(f"/proc/{pid}"), tag) == owner:  # again: the pid may have been reused before pidfd_open
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                killed.append(pid)
        except OSError:
            pass
        finally:
            os.close(fd)
    if placement().parents:  # and their cgroups, once their processes are gone
        end = time.monotonic() + 10.0
        while killed and any(o.split(".", 1)[0] != me for _, o in _marked(tag)) and time.monotonic() < end:
            time.sleep(0.01)
        sweep(tag + "_")
    return killed


def _wait_gone(marker: str, until: float) -> None:
    """Poll /proc until no process carries this call's marker (a killed namespace takes a
    moment to die), so `run` returns with nothing left."""
    tag, owner = marker.split(":", 1)
    while time.monotonic() < until:
        if not any(o == owner for _, o in _marked(tag)):
            return
        time.sleep(0.01)
    raise RuntimeError(f"sandbox {marker} still has processes 10 s after SIGKILL")

"""Limits over a whole sandbox (sandbox.py): one cgroup per call holding every process the tool
starts, with a memory limit (resident memory and tmpfs pages together) and a process count.
rlimits alone are per process: 64 processes of a 1 GiB address space each could hold 64 GiB.

Where the limits hold, in order of preference:
- cgroup v2 (`/sys/fs/cgroup` is cgroup2) when the rank's cgroup is writable and offers the
  memory and pids controllers: a parent `hpc_rl_sandboxes` under it with both enabled for its
  children (v2 allows controllers only in cgroups without processes of their own), a child
  per call with memory.max, memory.swap.max 0 and pids.max;
- cgroup v1 when the memory and pids hierarchies are mounted and the rank's cgroup in each
  is writable (root on a node with v1, as this project's test machines): a child per call
  with memory.limit_in_bytes and pids.max;
- none: then `scope` says "process" and why, and only the rlimits hold.

The child joins its cgroup between fork and exec (sandbox._child_setup, before it drops to
the sandbox's uid), so no process of the tool ever runs outside it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

ROOT = Path("/sys/fs/cgroup")
PARENT = "hpc_rl_sandboxes"


def _own_paths() -> dict:
    """{controller or "": this process's cgroup path} from /proc/self/cgroup."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            out[c] = path
    return out


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


@dataclass
class Placement:
    """Where this node can put whole-sandbox limits: `scope` ("cgroup v2", "cgroup v1" or
    "process"), the parent directory per hierarchy, and why not when scope is "process"."""

    scope: str
    parents: Tuple[Path, ...] = ()
    why_not: str = ""


def _v2() -> Placement:
    own = ROOT / _own_paths().get("", "/").lstrip("/")
    if not {"memory", "pids"} <= set((own / "cgroup.controllers").read_text().split()):
        return Placement("process", why_not=f"{own} offers no memory and pids controllers (not delegated)")
    parent = own / PARENT
    parent.mkdir(exist_ok=True)
    # processes in `own` (this rank) forbid enabling controllers for its children: move them to a leaf
    procs = (own / "cgroup.procs").read_text().split()
    if procs:
        leaf = own / "hpc_rl_rank"
        leaf.mkdir(exist_ok=True)
        for pid in procs:
            try:
                _write(leaf / "cgroup.procs", pid)
            except ProcessLookupError:
                pass
    _write(own / "cgroup.subtree_control", "+memory +pids")
    _write(parent / "cgroup.subtree_control", "+memory +pids")
    return Placement("cgroup v2", (parent,))


def _v1() -> Placement:
    own = _own_paths()
    parents = []
    for ctrl in ("memory", "pids"):
        mount = ROOT / ctrl
        if ctrl not in own or not (mount / "cgroup.procs").exists():
            return Placement("process", why_not=f"no cgroup v1 {ctrl} hierarchy at {mount}")
        parent = mount / own[ctrl].lstrip("/") / PARENT
        parent.mkdir(exist_ok=True)
        parents.append(parent)
    return Placement("cgroup v1", tuple(parents))


def _can_create(parents) -> None:
    """A child cgroup made and removed in each parent, or the OSError that says why not."""
    for parent in parents:
        probe = parent / f"probe_{os.getpid()}"
        probe.mkdir()
        probe.rmdir()


_placement: Optional[Placement] = None


def placement() -> Placement:
    """Found once per process: a cgroup hierarchy this process may create sandboxes' cgroups in."""
    global _placement
    if _placement is None:
        try:
            _placement = _v2() if (ROOT / "cgroup.controllers").exists() else _v1()
            _can_create(_placement.parents)
            sweep()
        except OSError as exc:
            _placement = Placement("process", why_not=f"cannot create cgroups here ({type(exc).__name__}: {exc}); "
                                                      "delegate a cgroup v2 subtree to the job (Slurm: cgroup/v2 "
                                                      "with the task cgroup writable) or run the env ranks as root")
    return _placement


class SandboxCgroup:
    """One call's cgroup in every hierarchy of the placement."""

    def __init__(self, name: str, memory_bytes: int, nproc: int):
        where = placement()
        self.scope, self.dirs = where.scope, [p / name for p in where.parents]
        for d in self.dirs:
            d.mkdir()
        for d in self.dirs:
            if where.scope == "cgroup v2":
                _write(d / "memory.max", str(memory_bytes))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
                _write(d / "pids.max", str(nproc))
            elif (d / "memory.limit_in_bytes").exists():
                _write(d / "memory.limit_in_bytes", str(memory_bytes))
            else:
                _write(d / "pids.max", str(nproc))
        # what the child writes "0" into (itself) before exec: bytes, bound before the fork
        self.join_files: List[bytes] = [str(d / "cgroup.procs").encode() for d in self.dirs]

    def oom_kills(self) -> int:
        """Processes the kernel killed for the sandbox's memory limit."""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):
                f = d / name
                if f.exists():
                    for line in f.read_text().splitlines():
                        key, _, val = line.partition(" ")
                        if key == "oom_kill":
                            return int(val)
        return 0

    def peak_bytes(self) -> Optional[int]:
        for d in self.dirs:
            for name in ("memory.peak", "memory.max_usage_in_bytes"):
                if (d / name).exists():
                    return int((d / name).read_text().split()[0])
        return None

    def remove(self, timeout_s: float = 10.0) -> None:
        """rmdir once its processes are gone (a killed pid namespace takes a moment to empty)."""
        end = time.monotonic() + timeout_s
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.01)


def sweep(tag: str = "") -> List[str]:
    """Remove the sandboxes' cgroups (of `tag`, or all) whose caller is gone and that hold no
    process: a SIGKILLed rank never reaches its sandbox's removal. Names are tag_<pid>.<n>."""
    gone = []
    for parent in placement().parents:
        for d in parent.iterdir():
            if not d.is_dir() or not d.name.startswith(tag):
                continue
            try:
                pid = int(d.name.rsplit("_", 1)[1].split(".")[0])
                if Path(f"/proc/{pid}").exists() or (d / "cgroup.procs").read_text().strip():
                    continue
                d.rmdir()
                gone.append(str(d))
            except (ValueError, IndexError, OSError):
                continue
    return gone


def join_in_child(files: List[bytes]) -> None:
    """Between fork and exec: this process into its sandbox's cgroups (only os builtins)."""
    for f in files:
        fd = os.open(f, os.O_WRONLY)
        os.write(fd, b"0")
        os.close(fd)

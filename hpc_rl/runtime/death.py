"""How a rank's process died, in words: the one place exit statuses become sentences.

A rank killed by a signal used to be reported as a bare "exited 137", and its peers then said
only that it "stopped answering"; a trainer killed by the kernel's OOM killer looked like any
other crash. Every reporter (the rank supervisor's error report, which the local launcher and
the batch shell's job_exit.json both quote, and the local launcher's own line) words the
status here, so they cannot drift apart.

Where the signal was SIGKILL, the kernel may have left its word: the oom_kill counter of the
rank's memory cgroup (cgroup v2 `memory.events`, v1 `memory.oom_control`), read before the
rank starts and after it dies, and the kernel log's "Killed process <pid>" line (`dmesg`,
often not readable by a user: then quietly skipped). Where neither names an OOM kill, the
message says SIGKILL came from outside and nothing named who.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

SIGNAL_EXIT_BASE = 128  # a shell (and runtime/supervise.py) reports death by signal N as 128 + N
CGROUP_ROOT = Path("/sys/fs/cgroup")
OOM_HINT = ("the role needs more memory than its node gives it: lower the rows or tokens one forward holds "
            "(trainer.micro_batch_size, the sampling max_tokens, shorter prompts) or spread the role over more nodes")


def signal_of(rc: Optional[int]) -> Optional[int]:
    """The signal that ended a process with status `rc` (a negative Popen status, or a shell's
    128 + N), or None when it exited by itself."""
    if rc is None:
        return None
    n = -rc if rc < 0 else rc - SIGNAL_EXIT_BASE if rc > SIGNAL_EXIT_BASE else 0
    return n if 0 < n < signal.NSIG else None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_status(rc: Optional[int]) -> str:
    """'killed by SIGKILL (signal 9)' or 'exited 3': a status, without the search for a cause."""
    n = signal_of(rc)
    if n is None:
        return f"exited {rc}"
    return f"was killed by {signal_name(n)} (signal {n})"


def _cgroup_files() -> List[Path]:
    """This process's memory cgroup files holding an oom_kill counter (v2 and v1)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:  # never seen; but the supervisor must start the rank whatever this says
            continue
        _, ctrls, path = parts
        rel = path.lstrip("/")
        if ctrls == "":
            out.append(CGROUP_ROOT / rel / "memory.events")
        elif "memory" in ctrls.split(","):
            out.append(CGROUP_ROOT / "memory" / rel / "memory.oom_control")
    return [f for f in out if f.exists()]


def _oom_kills(path: Path) -> Optional[int]:
    try:
        for line in path.read_text().splitlines():
            key, _, val = line.partition(" ")
            if key == "oom_kill":
                return int(val)
    except (OSError, ValueError):
        pass
    return None


class OomWatch:
    """The oom_kill counters of this process's memory cgroup, read when the rank starts, so a
    kill during the rank shows as a rise. The child shares the supervisor's cgroup (the
    supervisor never moves it); other processes of that cgroup may rise it too, which the
    message says by naming the counter, not the pid."""

    def __init__(self):
        self.before: Dict[Path, Optional[int]] = {f: _oom_kills(f) for f in _cgroup_files()}

    def rises(self) -> List[str]:
        out = []
        for f, before in self.before.items():
            after = _oom_kills(f)
            if after is not None and after > (before or 0):
                out.append(f"{f.name} oom_kill {before or 0} -> {after} in {f.parent}{_limit(f.parent)}")
        return out


def _limit(cgroup: Path) -> str:
    """', limit N MiB' when the cgroup has a memory limit (v2 memory.max, v1 limit_in_bytes)."""
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            value = int((cgroup / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):  # absent, or "max": no limit
            continue
        if value < 1 << 60:  # v1 writes an unlimited cgroup as a page-rounded 2**63
            return f", limit {value >> 20} MiB"
    return ""


def kernel_log_oom(pid: int, timeout_s: float = 3.0) -> List[str]:
    """The kernel log's OOM-killer word on `pid` ("Killed process <pid> (python) total-vm:...,
    anon-rss:...": its resident size when killed), or [] when there is none or `dmesg` cannot
    be read (a user without CAP_SYSLOG, kernel.dmesg_restrict: common, not an error)."""
    try:
        text = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    killed = re.findall(rf"Killed process {pid} \([^)]*\)(?: total-vm:\d+kB, anon-rss:\d+kB)?", text)
    if killed:
        return killed[-1:]
    # older kernels word it differently; the oom-kill summary line names the pid too
    return [m.strip() for m in re.findall(rf"oom-kill:.*\bpid={pid}\b.*", text)][-1:]


def explain(rc: Optional[int], pid: Optional[int] = None, watch: Optional[OomWatch] = None) -> str:
    """The whole sentence for a process `pid` that ended with status `rc`: its signal, and for
    SIGKILL whether the kernel's OOM killer says it was its doing (with the fix), or that
    nothing named who sent it."""
    n = signal_of(rc)
    if n != signal.SIGKILL:
        return describe_status(rc)
    evidence = (watch.rises() if watch is not None else []) + [f"kernel log: {line}" for line in
                                                               (kernel_log_oom(pid) if pid else [])]
    if evidence:
        return f"was killed by the kernel's OOM killer (SIGKILL, signal 9; {'; '.join(evidence)}): {OOM_HINT}"
    return ("was killed by SIGKILL (signal 9) from outside: the OOM killer, the scheduler or a person; "
            "no memory cgroup counter or kernel log line named which")

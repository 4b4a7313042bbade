"""The math judge in a helper process, for verifier calls from threads other than the main one.

math-verify bounds its work with SIGALRM, which Python lets only the main thread set. Off the
main thread it must run without its timeouts, and a thread cannot be stopped: measured here,
comparing `$10^{10^{10}}$` with 5 in a worker thread kept the whole process (main thread
included) stuck for more than 27 s. So calls from other threads go, one at a time, to one
helper process per calling process, whose main thread runs math-verify with its timeouts;
a reply that has not come by the deadline gets the helper killed (it is started again on
the next call) and the answer scored 0 with the reason.

The helper dies with its parent: it exits when its stdin closes, and each request caps its
CPU time (RLIMIT_CPU, SIGXCPU), so a helper orphaned in the middle of a long computation
still ends. Protocol: JSON lines on stdin/stdout, "ready" (or "error: ...") once at start.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

from .math_judge import Judgement

STARTUP_S = 120.0  # importing sympy and math-verify: about 1 s idle, much more on a busy node


class WorkerError(RuntimeError):
    pass


def _read_line(proc: subprocess.Popen, timeout_s: float) -> Optional[str]:
    """One reply line, or None on timeout or when the helper has died."""
    fd, buf, end = proc.stdout.fileno(), b"", time.monotonic() + timeout_s
    while not buf.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        buf += chunk
    return buf.decode()


class JudgeWorker:
    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self.starts = 0  # helper processes started (tests and logs read it)

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the helper imports this very hpc_rl
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen([sys.executable, "-m", "hpc_rl.envs.math_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0)
        self.starts += 1
        line = _read_line(proc, STARTUP_S)
        if line is None or line.strip() != "ready":
            self._kill(proc)
            raise WorkerError(f"math-verify helper did not start: {(line or 'no reply').strip()}")
        return proc

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            f.close()

    def judge(self, args: List[object], timeout_s: int, deadline_s: float) -> Judgement:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            try:
                proc.stdin.write((json.dumps({"args": args, "timeout_s": timeout_s, "cpu_s": int(deadline_s) + 1}) + "\n").encode())
                proc.stdin.flush()
                line = _read_line(proc, deadline_s)
            except OSError:  # the helper died under us (broken pipe)
                line = None
            if line is None:
                died = proc.poll() is not None
                self._kill(proc)
                self._proc = None
                raise WorkerError("math-verify helper died" if died else f"math-verify helper gave no answer in {deadline_s:g} s; killed")
            correct, shown, reason = json.loads(line)
            return bool(correct), shown, reason

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.stdin.close()  # the helper exits at end of input
                try:
                    self._proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
                self._kill(self._proc)
                self._proc = None


WORKER = JudgeWorker()
atexit.register(WORKER.close)


def _cap_cpu(seconds: int) -> None:
    import resource

    used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(used) + seconds
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def main() -> None:
    reply = os.fdopen(os.dup(1), "w")  # the protocol's channel; stray prints go to stderr
    os.dup2(2, 1)
    try:
        import math_verify  # noqa: F401  (its import cost is paid before "ready")

        from hpc_rl.envs.math_judge import judge
    except Exception as e:  # reported to the parent, which scores 0 with it
        reply.write(f"error: {type(e).__name__}: {e}\n")
        reply.flush()
        return
    reply.write("ready\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        _cap_cpu(req["cpu_s"])
        try:
            out = judge(*req["args"], timeout_s=req["timeout_s"])
        except Exception as e:
            out = (False, None, f"math-verify error: {type(e).__name__}: {e}")
        reply.write(json.dumps(out) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()

"""Failure injection for chaos tests (`ft.inject_failure`), parsed in one place.

"<role>:<rank>[:<how>][@<step>]": how is raise (an exception, the default), freeze
(SIGSTOP the process: a hung node that only heartbeats can notice), kill (SIGKILL:
a crashed process), hang (the main thread blocks forever while heartbeats go on: a
stuck collective, which only the progress watchdog notices) or stall<N> (the rank sleeps
N seconds, then goes on: a straggler; the drills use it to land a signal inside a step,
however fast the machine runs the steps; it ends early once the run directory's
`release_stall` file exists, which a drill creates when it has seen what it waited for). Without @step it fires at start-up, after rendezvous; with it, at the
start of that training step; with @train<N> (trainer ranks), inside step N's train phase,
after its batch is collected and before the forward and backward passes (a train step that
outlasts the refit deadline); with @save<N>, inside the checkpoint save of step N, after the
shards are written and before the save is published. It fires on the first run only (restart 0), so a requeued
job recovers instead of failing again; with a /restart<N> suffix it fires on attempt N instead.
Several injections join with "+" ("trainer:0:stall60@3+generator:0:kill@6/restart1"): one
job then goes through several interruptions in turn (the chaos drills share a job so).
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from typing import List, Optional, Union

_HOW = re.compile(r"raise|freeze|kill|hang|stall(\d+)")
_RESTART = re.compile(r"(.+)/restart(\d+)")


@dataclass(frozen=True)
class Injection:
    role: str
    rank: int
    how: str = "raise"
    stall_s: int = 0  # how == "stall": seconds the rank sleeps
    step: Union[None, int, str] = None  # a training step, "train<N>" (its train phase) or "save<N>" (its save)
    restart: int = 0  # the attempt it fires on


FORMAT = "<role>:<rank>[:raise|freeze|kill|hang|stall<seconds>][@step|@train<step>|@save<step>][/restart<N>]"


def parse_injections(spec: str) -> List[Injection]:
    """Every injection of `spec` ("+"-joined); raises ValueError saying what is wrong."""
    out = [parse_injection(part) for part in spec.split("+")]
    seen = {(i.role, i.rank, i.step, i.restart) for i in out}
    if len(seen) != len(out):
        raise ValueError(f"{spec}: two injections at the same rank, place and restart")
    return out


def parse_injection(spec: str) -> Injection:
    """One injection; raises ValueError saying what is wrong."""
    m = _RESTART.fullmatch(spec)  # role names hold "/" too (teacher/general): only a trailing /restart<N>
    spec, restart = (m.group(1), int(m.group(2))) if m else (spec, 0)
    body, _, step = spec.partition("@")
    parts = body.split(":")
    how, stall_s = "raise", 0
    m = _HOW.fullmatch(parts[-1]) if len(parts) >= 3 else None
    if m:
        parts.pop()
        how, stall_s = ("stall", int(m.group(1))) if m.group(1) else (m.group(0), 0)
    if len(parts) < 2 or not parts[-1].isdigit():
        raise ValueError(f"expected {FORMAT}")
    at: Union[None, int, str] = None
    if step:
        if step.isdigit():
            at = int(step)
        elif any(step.startswith(p) and step[len(p):].isdigit() for p in ("save", "train")):
            at = step
        else:
            raise ValueError(f"@{step}: expected a step number, train<step> or save<step>")
    return Injection(":".join(parts[:-1]), int(parts[-1]), how, stall_s, at, restart)


def maybe_inject(spec: Optional[str], role: str, role_rank: int, restart: int, step: Union[None, int, str] = None) -> None:
    if not spec:
        return
    for inj in parse_injections(spec):
        if (inj.role, inj.rank, inj.step, inj.restart) == (role, role_rank, step, restart):
            _fire(inj, spec, role, role_rank, step)


def _fire(inj: Injection, spec: str, role: str, role_rank: int, step: Union[None, int, str]) -> None:
    where = f"{role}:{role_rank}" + (f" at step {step}" if step is not None else "")
    if inj.how == "kill":
        print(f"hpc_rl: injected failure: SIGKILL on {where} (ft.inject_failure={spec})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if inj.how == "hang":  # alive and beating, but its main thread never returns (a hung collective)
        print(f"hpc_rl: injected failure: hang on {where} (ft.inject_failure={spec})", flush=True)
        while True:
            time.sleep(3600)
    if inj.how == "stall":
        print(f"hpc_rl: injected failure: {where} stalls for {inj.stall_s}s (ft.inject_failure={spec})", flush=True)
        _stall(inj.stall_s)
        return
    if inj.how == "freeze":
        print(f"hpc_rl: injected failure: SIGSTOP on {where} (ft.inject_failure={spec})", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    raise RuntimeError(f"injected failure on {where} (ft.inject_failure={spec})")


def _stall(seconds: float) -> None:
    """Sleep `seconds`, or less once the run directory's release file exists."""
    from hpc_rl.rundir import RunDir
    from hpc_rl.runtime.env import RUN_DIR

    release = RunDir(os.environ[RUN_DIR]).stall_release if os.environ.get(RUN_DIR) else None
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if release is not None and release.exists():
            print(f"hpc_rl: injected stall released after {seconds - (end - time.monotonic()):.1f}s", flush=True)
            return
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))

"""What a rank runs after rendezvous, by `run.program`."""

from __future__ import annotations

from typing import Callable, Dict


def _comm_check() -> Callable:
    from .comm_check import run

    return run


def _rl() -> Callable:
    from hpc_rl.rl.loop import run

    return run


# name -> loader of the program's entry (imported lazily: the RL loop pulls in vLLM)
PROGRAMS: Dict[str, Callable[[], Callable]] = {"comm_check": _comm_check, "rl": _rl}


def available() -> list:
    return sorted(PROGRAMS)

"""Task name -> verifier. Rewards are 1.0 for a correct response, 0.0 otherwise."""

from __future__ import annotations

from typing import Callable, Dict, List

from hpc_rl.agentic.calculator import verify_calculator

from .math_verifier import VerifierResult, verify_math
from .string_tasks import verify_reverse

Verifier = Callable[[str, str], VerifierResult]

VERIFIERS: Dict[str, Verifier] = {
    "addition": verify_math,
    "multiplication": verify_math,
    "math": verify_math,
    "reverse": verify_reverse,
    # the final answer of the agentic calculator task (hpc_rl/agentic/calculator.py): one integer
    "calculator": verify_calculator,
}


class UnknownTaskError(KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message, quotes and all
        return str(self.args[0])


def known_tasks() -> List[str]:
    return sorted(VERIFIERS)


def get_verifier(task: str) -> Verifier:
    try:
        return VERIFIERS[task]
    except KeyError:
        raise UnknownTaskError(f"no verifier for task {task!r}; known tasks: {', '.join(known_tasks())}") from None


def register(task: str, verifier: Verifier) -> None:
    """Add a task's verifier; re-registering a name is refused so two envs cannot clash silently."""
    if task in VERIFIERS and VERIFIERS[task] is not verifier:
        raise ValueError(f"task {task!r} already has a verifier ({VERIFIERS[task].__name__})")
    VERIFIERS[task] = verifier


def score(task: str, response: str, answer: str) -> VerifierResult:
    return get_verifier(task)(response, answer)

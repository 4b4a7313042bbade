"""Task name -> verifier. Rewards are 1.0 for a correct response, 0.0 otherwise.

Each task also names how its reference answers are checked when the dataset is loaded
(`answer_problem`, rl/inputs.py through envs/rows.py): a row the verifier could not score
is refused before anything is submitted, not discovered mid-run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, Optional

from hpc_rl.agentic.calculator import calculator_answer_problem, verify_calculator
from hpc_rl.agentic.faults import error_kind, traceback_line

from .math_verifier import VerifierResult, math_answer_problem, verify_math
from .reward_check import checked_reward
from .string_tasks import reverse_answer_problem, verify_reverse

Verifier = Callable[[str, str], VerifierResult]
# a reference answer -> what is wrong with it ("is empty": read after "the answer"), or None
AnswerCheck = Callable[[str], Optional[str]]

VERIFIERS: Dict[str, Verifier] = {
    "addition": verify_math,
    "multiplication": verify_math,
    "math": verify_math,
    "reverse": verify_reverse,
    # the final answer of the agentic calculator task (hpc_rl/agentic/calculator.py): one integer
    "calculator": verify_calculator,
}
ANSWER_CHECKS: Dict[str, AnswerCheck] = {
    "addition": math_answer_problem,
    "multiplication": math_answer_problem,
    "math": math_answer_problem,
    "reverse": reverse_answer_problem,
    "calculator": calculator_answer_problem,
}
REASON_CHARS = 300  # a failure's reason as kept: an exception's text may quote the whole response


class UnknownTaskError(KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message, quotes and all
        return str(self.args[0])


def known_tasks() -> List[str]:
    return sorted(VERIFIERS)


def get_verifier(task: str) -> Verifier:
    try:
        return VERIFIERS[task]
    except (KeyError, TypeError):  # TypeError: an unhashable "task" from a hand-made row
        raise UnknownTaskError(f"no verifier for task {task!r}; known tasks: {', '.join(known_tasks())}") from None


def register(task: str, verifier: Verifier, answer_check: Optional[AnswerCheck] = None) -> None:
    """Add a task's verifier (and, optionally, the load-time check of its reference answers);
    re-registering a name is refused so two envs cannot clash silently."""
    if task in VERIFIERS and VERIFIERS[task] is not verifier:
        raise ValueError(f"task {task!r} already has a verifier ({VERIFIERS[task].__name__})")
    VERIFIERS[task] = verifier
    if answer_check is not None:
        ANSWER_CHECKS[task] = answer_check


def answer_problem(task: str, answer: Optional[str]) -> Optional[str]:
    """Why `task`'s verifier cannot score rows with this reference answer, or None when it can.
    An unknown task raises UnknownTaskError; a task registered without a check needs an answer."""
    get_verifier(task)
    if answer is None:
        return "is missing: the verifier has nothing to compare with"
    check = ANSWER_CHECKS.get(task)
    return check(answer) if check is not None else None


def score(task: str, response: str, answer: str) -> VerifierResult:
    """The verifier's result for one response. Never raises over the response or a verifier's
    failure: a verifier that raises, or returns a reward reward_check refuses (NaN, text,
    out of bounds), gives reward 0 with `error` (the kind, counted by the caller) and `reason`
    (the traceback's last line). A task without a verifier still raises UnknownTaskError: rows
    are checked at load (envs/rows.py), so that is a caller's bug, not the policy's text."""
    verifier = get_verifier(task)
    try:
        res = verifier(response, answer)
        reward = checked_reward(res.reward, f"the verifier of task {task!r}")
        correct = bool(res.correct)
    except Exception as exc:  # RecursionError and MemoryError included: one row, never the rank
        return VerifierResult(False, 0.0, None, traceback_line(exc)[:REASON_CHARS], error_kind(exc))
    return replace(res, reward=reward, correct=correct)  # a plain float and bool, whatever came back

"""Reward environments: verifiers for the synthetic tasks and a task -> verifier registry."""

from .math_verifier import VerifierResult, extract_answer, parse_number, verify_math
from .registry import UnknownTaskError, get_verifier, known_tasks, register, score
from .string_tasks import verify_reverse

__all__ = [
    "UnknownTaskError", "VerifierResult", "extract_answer", "get_verifier", "known_tasks",
    "parse_number", "register", "score", "verify_math", "verify_reverse",
]

"""String tasks: word reversal."""

from __future__ import annotations

import re

from typing import Optional

from .math_verifier import VerifierResult

# Models wrap short answers in quotes, backticks or a closing period: "'elppa'." is elppa.
_STRIP_CHARS = " \t\r\n\"'`.,;:!?*()[]{}\u2018\u2019\u201c\u201d"
_LEAD_IN = re.compile(r"^(?:the\s+)?(?:reversed\s+word|reverse|answer)\s*(?:is|:)\s*", re.IGNORECASE)


def normalize_word(text: str) -> str:
    s = text.strip().strip(_STRIP_CHARS)
    s = _LEAD_IN.sub("", s)  # "Answer: elppa" / "The reversed word is elppa"
    return s.strip(_STRIP_CHARS).lower()


def verify_reverse(response: str, answer: str) -> VerifierResult:
    """Exact match after trimming whitespace, quotes and punctuation; case-insensitive."""
    got = normalize_word(response)
    correct = bool(got) and got == normalize_word(answer)
    return VerifierResult(correct, 1.0 if correct else 0.0, got or None)


def reverse_answer_problem(answer: str) -> Optional[str]:
    """A load-time row check: a reference that trims to nothing no response can match."""
    if not normalize_word(answer):
        return "is empty once quotes, punctuation and spaces are trimmed: no response can match it"
    return None

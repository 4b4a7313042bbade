"""Numeric answers: pull the final answer out of a response and compare it with the reference.

Where the answer is taken from, in order (the last occurrence of each wins, because models
restate the question and show working before concluding):
  1. \\boxed{...}              (braces may nest: \\boxed{\\frac{3}{4}})
  2. "#### 42"                 (GSM8K style)
  3. "answer: 42", "answer is 42", "answer = 42"
  4. the last number anywhere in the text
Numbers compare exactly as fractions after normalisation: thousands commas, a leading '+',
trailing zeros ("42.00"), "-0" == "0", and "3/4" == "0.75".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import List, Optional


@dataclass(frozen=True)
class VerifierResult:
    correct: bool
    reward: float  # 1.0 when correct, else 0.0
    extracted: Optional[str]  # the answer as found in the response; None when none was found


# A sign counts only where it cannot be a binary operator ("8-5" is 8 and 5, not 8 and -5).
_NUMBER = r"(?:(?<![\w.)])[-+\u2212])?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:/\d+)?"
NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_ANSWER_RE = re.compile(r"answer\s*(?:is\s*:?|:|=)\s*\$?\s*(" + _NUMBER + ")", re.IGNORECASE)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_PLAIN_NUM_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def _boxed_contents(text: str) -> List[str]:
    """The contents of every \\boxed{...}, matching nested braces."""
    out = []
    for m in re.finditer(r"\\boxed\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end():i - 1])
    return out


def _clean_latex(s: str) -> str:
    s = _FRAC_RE.sub(r"\1/\2", s)
    # LaTeX thin spaces as thousands separators ("1\,000") and math-mode markers.
    return re.sub(r"\\[,!; ]|\$|\\left|\\right", "", s)


def extract_answer(text: str) -> Optional[str]:
    """The final answer's text as it appears in the response, or None."""
    boxed = _boxed_contents(text)
    if boxed:
        nums = NUMBER_RE.findall(_clean_latex(boxed[-1]))
        return nums[-1] if nums else None
    for pattern in (_HASHES_RE, _ANSWER_RE):
        found = pattern.findall(text)
        if found:
            return found[-1]
    nums = NUMBER_RE.findall(_clean_latex(text))
    return nums[-1] if nums else None


def parse_number(s: str) -> Optional[Fraction]:
    """'1,000' / '+5' / '42.00' / '-0' / '3/4' -> an exact Fraction; None if not a number."""
    s = s.strip().replace("\u2212", "-").replace(",", "")
    s = s.rstrip(".")  # "42." ends a sentence
    if "/" in s:
        num, _, den = s.partition("/")
        a, b = parse_number(num), parse_number(den)
        return a / b if a is not None and b else None
    if not _PLAIN_NUM_RE.fullmatch(s):
        return None
    return Fraction(s)


def verify_math(response: str, answer: str) -> VerifierResult:
    """Reward 1.0 when the response's final number equals the reference numerically.

    A reference that is not a number is compared as trimmed text, so a dataset with a
    symbolic answer gets an exact-match check rather than a crash mid-run.
    """
    extracted = extract_answer(response)
    if extracted is None:
        return VerifierResult(False, 0.0, None)
    ref = parse_number(_clean_latex(str(answer)))
    got = parse_number(extracted)
    if ref is None:
        correct = extracted.strip() == str(answer).strip()
    else:
        correct = got is not None and got == ref
    return VerifierResult(correct, 1.0 if correct else 0.0, extracted)

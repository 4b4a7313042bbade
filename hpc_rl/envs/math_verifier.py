"""Math answers: find the final answer in a response, then compare it with the reference.

Where the answer is taken from, in order (the last occurrence of each wins, because models
restate the question and show working before concluding):
  1. \\boxed{...}              (braces may nest: \\boxed{\\frac{3}{4}}); taken whole
  2. "#### 42"                 (GSM8K style)
  3. "answer: 42", "answer is 42", "answer = 42" (the complete number: not the 2 of "2\\sqrt{2}")
  4. in a response with LaTeX markup ($, \\( or a command): what math-verify finds there
     (math_judge.py says how), else
  5. the last number anywhere in the text.
How it is compared: two whole numbers exactly, in this process (the tiny tasks' answers: the
fast path, with the result math-verify would give; tens of microseconds against about 10 ms
a math-verify call, bench/verify_cost.py); anything else by Hugging Face's math-verify
(`parse` both, `verify`), as NeMo RL does: fractions, decimals to 6 places, roots, "x = 3"
against 3, sets. Plain numbers are normalised
first, here: thousands commas and LaTeX thin spaces, a leading '+', a Unicode minus,
trailing zeros ("42.00"), "-0" == "0", \\frac{3}{4} == "3/4" == "0.75".

math-verify runs in this process on the main thread (its SIGALRM timeouts work there) and in
a helper process from any other thread (math_worker.py), so its timeouts bound the call
either way (the helper's deadline on top). Nothing here raises on a response: what cannot be
judged scores 0, with the reason in `VerifierResult.reason`. Whole numbers are compared as
digit strings, never through int(): Python refuses to convert more than 4300 digits
(sys.set_int_max_str_digits), and a policy can write 10^5 of them. Answers nested deeper than
MAX_NESTING brackets are not handed to math-verify (its parse time grows steeply with depth).
"""

from __future__ import annotations

import re
import signal
import threading
import time
import unicodedata
from dataclasses import dataclass
from fractions import Fraction
from typing import List, Optional

# Per math-verify operation (parse the reference, parse the answer, each comparison), in
# whole seconds (SIGALRM): math-verify's own default. The helper process gets a deadline for
# the whole call on top; past it the helper is killed.
TIMEOUT_S = 5
HELPER_DEADLINE_S = 6 * TIMEOUT_S + 10
# Brackets ({ ( [) nested deeper than this in what math-verify would parse: scored 0 unjudged.
# Measured here: math-verify takes about 1 s at 8 levels, 2 s at 12, its 5 s timeout from 16;
# no real answer nests that deep, and a policy writing "{{{{..." must not cost 15 s a row.
MAX_NESTING = 12


@dataclass(frozen=True)
class VerifierResult:
    correct: bool
    reward: float  # 1.0 when correct, else 0.0
    extracted: Optional[str]  # the answer as found in the response; None when none was found
    reason: Optional[str] = None  # why the answer could not be judged (None when it was)
    # the kind of failure (an exception's class name) when scoring itself failed: the verifier
    # raised or returned a bad reward (registry.score sets it; the env rank counts it)
    error: Optional[str] = None


# A sign counts only where it cannot be a binary operator ("8-5" is 8 and 5, not 8 and -5).
_NUMBER = r"(?:(?<![\w.)])[-+\u2212])?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:/\d+)?"
# After a marker, the whole answer: not the 2 of "2\sqrt{2}", "2^3", "2x" or "1.5" cut at "1".
_WHOLE = r"(?!\s*[\\^_{]|\w|\.\d)"
NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*(" + _NUMBER + ")" + _WHOLE)
_ANSWER_RE = re.compile(r"answer\s*(?:is\s*:?|:|=)\s*\$?\s*(" + _NUMBER + ")" + _WHOLE, re.IGNORECASE)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_PLAIN_NUM_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_WHOLE_NUM_RE = re.compile(r"-?\d+(?:\.0*)?")
_LATEX_RE = re.compile(r"\$|\\[a-zA-Z(\[]")  # markup math-verify can read
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_BRACE_RE = re.compile(r"[{}]")


def _last_boxed(text: str) -> Optional[str]:
    """The contents of the last closed \\boxed{...} (braces may nest), or None. One pass over
    the braces with a stack: scanning on from each \\boxed{ would be quadratic, and a policy
    writing "\\boxed{" 10^4 times kept this loop busy for 46 s a row."""
    opens = {m.end() - 1 for m in _BOXED_RE.finditer(text)}  # where each \\boxed's brace is
    if not opens:
        return None
    stack: List[Optional[int]] = []  # per open brace: its index if it opens a \\boxed, else None
    last = None
    for m in _BRACE_RE.finditer(text, min(opens)):
        i = m.start()
        if text[i] == "{":
            stack.append(i if i in opens else None)
        elif stack:
            j = stack.pop()
            if j is not None and (last is None or j > last[0]):
                last = (j, i)
    return text[last[0] + 1:last[1]] if last else None


def _clean_latex(s: str) -> str:
    s = _FRAC_RE.sub(r"\1/\2", s)
    # LaTeX thin spaces as thousands separators ("1\,000") and math-mode markers.
    return re.sub(r"\\[,!; ]|\$|\\left|\\right", "", s)


def _last_number(text: str) -> Optional[str]:
    nums = NUMBER_RE.findall(_clean_latex(text))
    return nums[-1] if nums else None


def extract_answer(text: str) -> Optional[str]:
    """The final number by this module's own rules (boxed, ####, answer:, last number), or None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return _last_number(boxed)
    for pattern in (_HASHES_RE, _ANSWER_RE):
        found = pattern.findall(text)
        if found:
            return found[-1]
    return _last_number(text)


def _normalise(s: str) -> Optional[str]:
    """'1,000' -> '1000', '+5' -> '5', '\u22122' -> '-2', '42.' -> '42', '3/4' stays; None if not a plain number."""
    s = s.strip().replace("\u2212", "-").replace(",", "").rstrip(".")  # "42." ends a sentence
    num, slash, den = s.partition("/")
    parts = [num, den] if slash else [num]
    # a zero denominator is all zeros: no Fraction() here, whose int() refuses > 4300 digits
    if not all(_PLAIN_NUM_RE.fullmatch(p) for p in parts) or (slash and not re.search("[1-9]", den)):
        return None
    return "/".join(p.lstrip("+") for p in parts)


def parse_number(s: str) -> Optional[Fraction]:
    """'1,000' / '+5' / '42.00' / '-0' / '3/4' -> an exact Fraction; None if not a number, or
    one too long for Python to convert (more digits than sys.get_int_max_str_digits())."""
    n = _normalise(s)
    if n is None:
        return None
    num, _, den = n.partition("/")
    try:
        return Fraction(num) / Fraction(den) if den else Fraction(num)
    except ValueError:  # past the int digit limit
        return None


def canonical_integer(s: str) -> str:
    """A signed run of decimal digits ("+007", "-0", "\u0664\u0662") in one spelling ("7", "0",
    "42"): what int() would make of it, as text of any length (int() refuses > 4300 digits)."""
    s = s.strip()
    sign, digits = (s[0], s[1:]) if s[:1] in ("-", "+") else ("", s)
    if not digits.isascii():  # \d and int() read every script's digits
        digits = "".join(str(unicodedata.decimal(c)) for c in digits)
    digits = digits.lstrip("0") or "0"
    return digits if digits == "0" or sign != "-" else "-" + digits


def _whole(n: str) -> Optional[str]:
    """A normalised whole number ("42", "-0", "42.00") in one spelling ("42", "0", "42"), or
    None when `n` is not one; compared as text, digit by digit."""
    return canonical_integer(n.partition(".")[0]) if _WHOLE_NUM_RE.fullmatch(n) else None


def nesting(text: str) -> int:
    """The deepest bracket nesting ({ ( [ together) in `text`; one pass, no recursion."""
    depth = deepest = 0
    for ch in text:
        if ch in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "})]" and depth:
            depth -= 1
    return deepest


@dataclass(frozen=True)
class _Answer:
    text: str  # what is judged (see math_judge.judge's `kind`)
    kind: str  # "number" | "latex" | "search"
    shown: Optional[str]  # the answer as found, for VerifierResult.extracted
    fallback: Optional[str] = None  # "search": the last number, judged when math-verify finds nothing


def _number(found: str, latex: Optional[str] = None) -> _Answer:
    """A plain number is judged as one; anything else ("3/0", a boxed expression) as LaTeX."""
    n = _normalise(found)
    if n is not None:
        return _Answer(n, "number", found)
    expr = latex if latex is not None else found
    return _Answer(expr, "latex", expr.strip() or None)


def final_answer(text: str) -> Optional[_Answer]:
    """Where the final answer is and how to judge it, or None when there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return _number(_clean_latex(boxed).strip(), boxed)
    for pattern in (_HASHES_RE, _ANSWER_RE):
        found = pattern.findall(text)
        if found:
            return _number(found[-1])
    last = _last_number(text)
    if _LATEX_RE.search(text):
        return _Answer(text, "search", None, _normalise(last) if last else None)
    return _number(last) if last else None


def _keeping_timer(judge, args):
    """judge() on the main thread, with math-verify's timeouts. Its SIGALRM wrapper ends
    with alarm(0), which would cancel a timer the caller set (pytest-timeout's, a rank's
    own): the timer is set again to what is left of it (at least 1 ms)."""
    pending, interval = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    try:
        return judge(*args, timeout_s=TIMEOUT_S)
    finally:
        if pending:
            signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - start), 1e-3), interval)


def _judge(gold: str, ans: _Answer):
    from .math_judge import judge

    args = [gold, ans.text, ans.kind, ans.shown, ans.fallback]
    try:
        if threading.current_thread() is threading.main_thread():
            return _keeping_timer(judge, args)
        from .math_worker import WORKER

        return WORKER.judge(args, TIMEOUT_S, HELPER_DEADLINE_S)
    except Exception as e:  # never a crashed rank over one answer
        return False, ans.shown, f"math-verify failed: {type(e).__name__}: {e}"


def verify_math(response: str, answer: str) -> VerifierResult:
    """Reward 1.0 when the response's final answer equals the reference (see the module doc).

    A reference math-verify cannot read is compared as trimmed text, so a dataset with an
    odd answer gets an exact-match check rather than a crash mid-run.
    """
    ans = final_answer(response)
    if ans is None:
        return VerifierResult(False, 0.0, None, "no answer found")
    gold = str(answer)
    ref = _normalise(_clean_latex(gold))
    if ans.kind == "number" and ref is not None:
        a, b = _whole(ans.text), _whole(ref)
        if a is not None and b is not None:  # the fast path: two whole numbers
            return VerifierResult(a == b, 1.0 if a == b else 0.0, ans.shown)
    if max(nesting(ans.text), nesting(gold)) > MAX_NESTING:
        return VerifierResult(False, 0.0, ans.shown, f"nested deeper than {MAX_NESTING} brackets: not judged")
    correct, shown, reason = _judge(ref if ref is not None else gold, ans)
    return VerifierResult(correct, 1.0 if correct else 0.0, shown, reason)


def math_answer_problem(answer: str) -> Optional[str]:
    """Why verify_math cannot score against this reference answer (a load-time row check), or
    None. Anything else it reads: a plain number exactly, other text through math-verify, or
    as trimmed text when math-verify cannot parse it."""
    if not answer.strip():
        return "is empty"
    if nesting(answer) > MAX_NESTING:
        return f"nests brackets deeper than {MAX_NESTING} levels: the math verifier does not judge such answers"
    return None

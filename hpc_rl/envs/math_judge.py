"""math-verify's half of the math verifier: parse a reference and an answer, compare them.

Strings in, plain values out, so the same function runs in the caller's process (main
thread: math-verify's own signal-based timeouts work there) and in the helper process of
`math_worker.py` (any other thread). math_verify is imported on first use: integer answers
never reach this module, and the import costs about a second.

`kind` says what `text` is:
  "number"  a plain number, already normalised ("3/4", "-0.5", "1000");
  "latex"   one expression: the contents of the last \\boxed{...} in the response;
  "search"  the whole response: math-verify finds the answer (LaTeX in $...$, \\(...\\),
            \\[...\\], a bare \\frac, "final answer is ..."); if it finds none, a response of
            one short line is read as one expression, else `fallback` (the last number by
            the verifier's own rules) is judged.
"""

from __future__ import annotations

import time
from typing import List, Optional, Tuple

# (correct, the answer as found, why it could not be judged: None when math-verify judged it)
Judgement = Tuple[bool, Optional[str], Optional[str]]

ONE_LINE_MAX_CHARS = 200  # a "search" response this short, on one line, may be a bare expression


def _parse(text: str, timeout_s: Optional[int], expressions: bool = False) -> Tuple[List[object], Optional[str], bool]:
    """(sympy values, the matched text, timed out?)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()] if expressions else [LatexExtractionConfig()]
    start = time.monotonic()
    found = parse(text, configs, fallback_mode="first_match", parsing_timeout=timeout_s)
    slow = timeout_s is not None and time.monotonic() - start >= timeout_s
    values = [v for v in found if not isinstance(v, str)]
    matched = next((v for v in found if isinstance(v, str)), None)
    return values, matched, slow


def _boxed(expr: str) -> str:
    return "\\boxed{" + expr + "}"


def judge(gold: str, text: str, kind: str, shown: Optional[str], fallback: Optional[str],
          timeout_s: Optional[int]) -> Judgement:
    """Whether the answer in `text` equals `gold`; timeout_s None only off the main thread
    of a process that bounds the call itself (math-verify then sets no alarm)."""
    from math_verify import verify

    gold_values, _, slow = _parse(_boxed(gold), timeout_s)
    if slow:
        return False, shown, f"math-verify timed out ({timeout_s} s) parsing the reference"
    if kind == "search":
        values, shown, slow = _parse(text, timeout_s, expressions=True)
        line = text.strip()
        if not values and not slow and "\n" not in line and 0 < len(line) <= ONE_LINE_MAX_CHARS:
            values, _, slow = _parse(_boxed(line), timeout_s)
            shown = line if values else shown
        if not values and not slow and fallback is not None:
            values, _, slow = _parse(_boxed(fallback), timeout_s)
            shown = fallback
    else:
        values, _, slow = _parse(_boxed(text), timeout_s)
    if slow:
        return False, shown, f"math-verify timed out ({timeout_s} s) parsing the answer"
    if not gold_values:  # a reference math-verify cannot read: exact text, as before math-verify
        same = shown is not None and shown.strip() == gold.strip()
        return same, shown, "reference not parsed by math-verify; compared as text"
    if not values:
        return False, shown, "answer not parsed by math-verify" if shown else "no answer found"
    start = time.monotonic()
    ok = verify(gold_values, values, timeout_seconds=timeout_s)
    if not ok and timeout_s is not None and time.monotonic() - start >= timeout_s:
        return False, shown, f"math-verify timed out ({timeout_s} s) comparing"
    return bool(ok), shown, None

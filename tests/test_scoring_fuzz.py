"""Scoring never raises (issue #43): every verifier and tool an env rank calls on a policy's
text, fed random and pathological text, returns a finite reward in bounds (or a tool's error
text), never an exception. Before the fix a 5000-digit answer raised ValueError out of int()
(Python's 4300-digit limit) and killed the env rank; deep nesting cost math-verify its full
timeouts per row, and "\\boxed{" written 10^4 times a quadratic scan of 46 s; "[[[[..."
raised RecursionError out of json; a NUL in a tool argument made Popen raise on the rank.

The corpus: seeded random strings over digits, signs, brackets, LaTeX pieces, NUL, lone
surrogates and other scripts; plus the pathological cases by name (10^5-digit runs, 10^5
brackets deep, invalid UTF-8 decoded with surrogateescape, a 4 MB response).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from types import SimpleNamespace

import pytest

from hpc_rl.agentic.calculator import CalculatorEnv, calculate, CalculatorError
from hpc_rl.agentic.python_tool import MAX_ARG_BYTES, PythonToolEnv, argument_problem
from hpc_rl.agentic.tools import call_arguments, parse_tool_calls
from hpc_rl.envs.math_verifier import final_answer, parse_number, verify_math
from hpc_rl.envs.registry import VERIFIERS, known_tasks, score
from hpc_rl.envs.reward_check import REWARD_BOUND
from hpc_rl.envs.string_tasks import normalize_word

DEEP = 100_000
PATHOLOGICAL = {
    "digits_1e5": "9" * DEEP,
    "answer_is_1e5_digits": "The answer is " + "9" * DEEP,
    "boxed_1e5_digits": "\\boxed{" + "9" * DEEP + "}",
    "hashes_5000_digits": "#### " + "1" * 5000,
    "negative_zeros": "-" + "0" * DEEP,
    "fraction_zero_denominator_5000": "3/" + "0" * 5000,
    "fraction_5000_digits": "1" * 5000 + "/" + "7" * 5000,
    "decimal_5000_digits": "1." + "5" * 5000,
    "latex_1e5_digits": "$" + "1" * DEEP + "$",
    "parens_deep": "(" * DEEP + ")" * DEEP,
    "brackets_deep": "[" * DEEP + "]" * DEEP,
    "boxed_braces_deep": "\\boxed{" + "{" * DEEP + "1" + "}" * DEEP + "}",
    "frac_deep": "$" + "\\frac{1}{" * 1000 + "2" + "}" * 1000 + "$",
    "boxed_unclosed": "\\boxed{" * 10_000,
    "invalid_utf8": bytes(random.Random(1).randrange(256) for _ in range(10_000)).decode("utf-8", "surrogateescape"),
    "lone_surrogates": "\ud800 42 \udfff",
    "nul_bytes": "\x00" * 1000 + "42\x00",
    "other_scripts_digits": "\u0664\u0662",  # Arabic-Indic 42: int() reads it, so must we
    "huge_text": "word 12 " * 500_000,  # 4 MB
    "tool_call_deep": "[calculator(expression=" + "(" * DEEP + ")]",
    "tool_call_nul": '[python(code="print(\\x00)")]',
    "json_deep": "[" * DEEP,
}
PIECES = ["0", "1", "9", "42", "-", "+", ".", ",", "/", " ", "\n", "{", "}", "(", ")", "[", "]", "$", "\\boxed{",
          "\\frac{", "\\sqrt{", "^", "_", "answer: ", "#### ", "x", "\u00e9", "\u0664", "\x00", "\udcff", "\ud800",
          "\u2212", '[calculator(expression="', '")]', "'", '"', "\\", "\\(", "\\)", "=", "*"]
ANSWERS = ["42", "\\frac{1}{2}", "elppa", "1" * 5000]


def _random_texts(n: int = 150, seed: int = 43):
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 120))) for _ in range(n)]


CORPUS = list(PATHOLOGICAL.items()) + [(f"random_{i}", t) for i, t in enumerate(_random_texts())]


def _finite(reward) -> None:
    assert isinstance(reward, float) and math.isfinite(reward) and abs(reward) <= REWARD_BOUND, reward


def test_every_verifier_scores_any_text_without_raising():
    """Every registered verifier (once: several tasks share verify_math) through score(): it
    did not raise (error is None: score would have caught it and named the kind), and the
    reward is 0.0 or 1.0."""
    tasks = {VERIFIERS[t]: t for t in known_tasks()}.values()
    assert {VERIFIERS[t] for t in tasks} == set(VERIFIERS.values())
    for task in tasks:
        for name, text in CORPUS:
            for answer in (ANSWERS if name in PATHOLOGICAL else ANSWERS[:1]):
                t0 = time.perf_counter()
                res = score(task, text, answer)
                # bounded: math-verify's timeouts cap a call at 3 x 5 s; past that the verifier
                # itself is the cost (a quadratic scan took 46 s a row on "\\boxed{" x 10^4)
                assert time.perf_counter() - t0 < 20, (task, name)
                assert res.error is None, (task, name, answer[:20], res.reason)
                _finite(res.reward)
                assert res.reward in (0.0, 1.0) and isinstance(res.correct, bool)


def test_big_numbers_are_compared_exactly_as_text():
    big = "1" * 10_000
    assert verify_math(f"The answer is {big}", big).correct  # past int()'s 4300 digits
    assert not verify_math(f"The answer is {big}2", big).correct
    assert verify_math("-0", "0").correct and verify_math("007", "7").correct
    assert verify_math("\u0664\u0662", "42").correct  # the digits int() would have read
    assert VERIFIERS["calculator"](big, big).correct and not VERIFIERS["calculator"]("+" + big, big + "0").correct
    assert parse_number("1" * 5000) is None  # too long for a Fraction: None, not a ValueError


def test_deep_nesting_is_not_handed_to_math_verify():
    """16 levels cost math-verify its 5 s timeouts (measured); past MAX_NESTING the answer is
    scored 0 at once, with the reason."""
    for text in ("\\boxed{" + "{" * 16 + "1" + "}" * 16 + "}", "$" + "(" * 16 + "1" + ")" * 16 + "$"):
        t0 = time.perf_counter()
        r = verify_math(text, "42")
        assert time.perf_counter() - t0 < 1.0 and r.reward == 0.0 and "nested deeper than 12" in r.reason, r


def test_the_math_helpers_never_raise():
    for _, text in CORPUS:
        final_answer(text)
        parse_number(text)
        normalize_word(text)


def test_off_the_main_thread_the_helper_process_scores_odd_text():
    """The math-verify helper process (math_worker.py) gets the text as JSON: surrogates and
    NULs travel, and nothing it answers raises."""
    texts = [PATHOLOGICAL[k] for k in ("lone_surrogates", "nul_bytes", "invalid_utf8", "frac_deep")] + ["$\\frac{3}{4}$"]
    out = []
    t = threading.Thread(target=lambda: out.extend(verify_math(x, "3/4") for x in texts))
    t.start()
    t.join(120)
    assert len(out) == len(texts) and out[-1].correct
    for r in out:
        _finite(r.reward)


def _call(name: str, args) -> dict:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}


def test_the_calculator_tool_answers_any_call_with_text():
    env = CalculatorEnv()
    asyncio.run(env.reset({"prompt": "What is 6 times 7?", "answer": "42"}))
    for name, text in CORPUS:
        for call in (_call("calculator", {"expression": text}), _call("calculator", text), _call(text, "{}")):
            assert isinstance(env._run(call, 0), str), name
        try:
            calculate(text)
        except CalculatorError:  # the tool's own refusal, answered as an error text by _run
            pass
        new, done, reward, correct = asyncio.run(env.step({"role": "assistant", "content": text, "tool_calls": []}))
        assert done and reward in (0.0, 1.0)


def test_tool_arguments_and_calls_never_raise():
    class Raising:  # a tool parser that fails on the text (vLLM's may, on odd input)
        def extract_tool_calls(self, text, request):
            raise RecursionError("maximum recursion depth exceeded")

    for name, text in CORPUS:
        assert call_arguments(_call("x", text)) is None or isinstance(call_arguments(_call("x", text)), dict)
        assert parse_tool_calls(Raising(), text, 0) == (text, [], True)


class _Runner:
    """A stand-in for the sandbox pool: records the argv it would exec."""

    def __init__(self):
        self.argv = []

    async def run(self, argv, deadline):
        self.argv.append(argv)  # what python_tool.tool_text reads of a sandbox's result:
        return SimpleNamespace(exit_code=0, stdout="ok", stderr="", stdout_truncated=False, timed_out=False, wall_s=0.0)


def test_python_tool_hands_only_execable_arguments_to_the_sandbox():
    """A NUL, a lone surrogate or an argument past the kernel's limit would make Popen (or
    exec) fail on the env rank: the policy reads an error instead, and no such argv is run."""
    runner = _Runner()
    env = PythonToolEnv(runner, deadline=0.0)
    for name, text in CORPUS:
        for call in (_call("python", {"code": text}), _call("calculator", {"expression": text}), _call("python", text)):
            assert isinstance(asyncio.run(env._call(call, 0)), str), name
    assert runner.argv  # the ordinary texts did reach the sandbox
    for argv in runner.argv:
        assert argument_problem(argv[-1]) is None and "\x00" not in argv[-1]
        assert len(argv[-1].encode("utf-8", "surrogateescape")) <= MAX_ARG_BYTES


@pytest.mark.parametrize("parser_name", ["pythonic", "hermes"])
def test_vllms_tool_parsers_read_any_text(parser_name):
    """The real parsers the recipes name, on the corpus: content and calls, never an exception."""
    from transformers import AutoTokenizer

    from hpc_rl.agentic.tools import tool_parser
    from hpc_rl.rl.inputs import resolve_model_ref

    tok = AutoTokenizer.from_pretrained(resolve_model_ref("tiny_agentic:student_calc_200"))
    parser = tool_parser(parser_name, tok)
    for name, text in CORPUS:
        content, calls, malformed = parse_tool_calls(parser, text, 0, parser_name)
        assert isinstance(content, str) and isinstance(calls, list), name

"""The tiny agentic task: "What is 37 times 58?" is beyond a 2-layer character model's
arithmetic, but not beyond copying. A good trajectory:

    user       What is 37 times 58?
    assistant  [calculator(expression="37*58")]      (a pythonic tool call)
    tool       2146
    assistant  2146

Reward 1.0 when the final assistant answer is the product, else 0. The calculator evaluates
`a op b` for two integers and nothing else: the expression comes from the policy, and a
policy's text is never handed to eval.

Light on purpose (no torch, no vLLM, nothing of hpc_rl.envs at import): envs/registry.py
imports the verifier from here.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import List, Optional, Tuple

from .tools import call_arguments, function_tool

TOOL = function_tool("calculator", "Compute `a op b` for two integers a and b, op one of + - * /.", "expression", "e.g. 37*58")
MAX_DIGITS = 12  # per operand: bounds the work (and the answer's length) of one call
_EXPR = re.compile(r"\s*([-+]?\d{1,%d})\s*([-+*/x\u00d7])\s*([-+]?\d{1,%d})\s*" % (MAX_DIGITS, MAX_DIGITS))
_INT = re.compile(r"\s*[-+]?\d+\s*")


class CalculatorError(ValueError):
    pass


def calculate(expression) -> str:
    """The value of `a op b` as text; CalculatorError for anything else. Division is exact:
    a whole number, or a reduced fraction ("7/2"); by zero is an error."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    m = _EXPR.fullmatch(expression)
    if m is None:
        raise CalculatorError(f"not 'a op b' with integers a, b and op one of + - * /: {expression[:40]!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    if op == "+":
        return str(a + b)
    if op == "-":
        return str(a - b)
    if op in "*x\u00d7":
        return str(a * b)
    if b == 0:
        raise CalculatorError("division by zero")
    return str(Fraction(a, b))


def _integer(text: str) -> Optional[str]:
    """One integer's text in one spelling ("+007" -> "7"), or None when `text` is not one."""
    from hpc_rl.envs.math_verifier import canonical_integer  # here: envs/registry.py imports this module

    return canonical_integer(text) if _INT.fullmatch(text) else None


def calculator_answer_problem(answer: str) -> Optional[str]:
    """A load-time row check: the calculator task's reference must be one integer."""
    return None if _integer(answer) is not None else "is not one integer (the calculator task's answers are)"


def verify_calculator(response: str, answer: str):
    """Correct when the response is the answer: one integer, nothing else (the answer a tool
    user copies from the tool, not a number picked out of a sentence). A VerifierResult."""
    from hpc_rl.envs.math_verifier import VerifierResult  # here: envs/registry.py imports this module

    text = response.strip()
    got, ref = _integer(text), _integer(str(answer))
    if got is None:
        return VerifierResult(False, 0.0, None, "the response is not one integer")
    if ref is None:  # refused at load (calculator_answer_problem); never a crash mid-run
        return VerifierResult(False, 0.0, text, "the reference answer is not one integer")
    return VerifierResult(got == ref, 1.0 if got == ref else 0.0, text)


class CalculatorEnv:
    """Step-wise (contract.StepwiseEpisode): tool calls are answered with `tool` messages and
    the episode goes on; the first message without a tool call is the final answer."""

    tools = [TOOL]

    def __init__(self, max_tool_calls: int = 4):
        self.max_tool_calls = max_tool_calls  # per assistant message; more are answered with an error
        self.answer: Optional[str] = None

    async def reset(self, task: dict) -> List[dict]:
        self.answer = str(task["answer"])
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, message: dict) -> Tuple[List[dict], bool, float, Optional[bool]]:
        calls = message.get("tool_calls") or []
        if not calls:
            r = verify_calculator(message.get("content") or "", self.answer)
            return [], True, r.reward, r.correct
        texts = await self._answer_calls(calls)
        return [{"role": "tool", "content": t, "tool_call_id": c.get("id", "")} for t, c in zip(texts, calls)], False, 0.0, None

    async def _answer_calls(self, calls: List[dict]) -> List[str]:
        """The tool messages' texts for one assistant message's calls (in order)."""
        return [self._run(call, i) for i, call in enumerate(calls)]

    def _run(self, call: dict, i: int) -> str:
        if i >= self.max_tool_calls:
            return f"error: at most {self.max_tool_calls} calls per message"
        name = call.get("function", {}).get("name")
        if name != "calculator":
            return f"error: no tool named {name!r}"
        args = call_arguments(call)
        if args is None or set(args) != {"expression"}:
            return "error: calculator takes one argument, expression"
        try:
            return calculate(args["expression"])
        except CalculatorError as exc:
            return f"error: {exc}"

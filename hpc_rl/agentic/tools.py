"""Tool calls in the policy's text, parsed by vLLM's own tool parsers (chosen by name per
recipe: `pythonic`, `hermes`, `llama3_json`, ...), so that an episode reads a tool call the
way vLLM's OpenAI server would have returned it.

The tiny recipe uses `pythonic`: the policy writes `[calculator(expression="37*58")]`; it
needs no special tokens, and the tiny character tokenizer has none for tools.
"""

from __future__ import annotations

import json
import logging
from typing import Dict, List, Optional, Tuple

_PARSERS: Dict[Tuple[str, int], object] = {}
# How a call that did not parse starts, per parser: such turns are counted (`malformed`)
_CALL_OPENS = {"pythonic": "[", "llama4_pythonic": "[", "hermes": "<tool_call>"}


def tool_parser(name: str, tokenizer):
    """vLLM's parser `name` for `tokenizer`, made once per (name, tokenizer): the non-streaming
    `extract_tool_calls` keeps no state between calls."""
    key = (name, id(tokenizer))
    if key not in _PARSERS:
        from vllm.tool_parsers import ToolParserManager

        cls = ToolParserManager.get_tool_parser(name)
        # A policy that writes a malformed call (the usual case for an untrained student) is
        # not an error of ours: the parser would log a traceback per call; we count them instead.
        logging.getLogger(cls.__module__).setLevel(logging.CRITICAL)
        _PARSERS[key] = cls(tokenizer)
    return _PARSERS[key]


def parse_tool_calls(parser, text: str, turn: int, name: str = "pythonic") -> Tuple[str, List[dict], bool]:
    """(content, tool calls in the OpenAI shape, whether the text looked like a call the
    parser could not read). Call ids are `call_<turn>_<i>`, not the parser's random ones, so
    that a template that renders them renders the same text on a rerun."""
    try:
        info = parser.extract_tool_calls(text, None)
    except Exception:  # a parser that fails on the policy's text (deep nesting, odd bytes): a
        # malformed turn, counted, never the episode's error
        return text, [], True
    calls = []
    for i, c in enumerate(info.tool_calls if info.tools_called else []):
        calls.append({"id": f"call_{turn}_{i}", "type": "function",
                      "function": {"name": c.function.name, "arguments": c.function.arguments}})
    content = info.content if info.content is not None else ""
    opens = _CALL_OPENS.get(name)
    malformed = bool(opens) and not calls and text.lstrip().startswith(opens)
    return content, calls, malformed


def call_arguments(call: dict) -> Optional[dict]:
    """A tool call's arguments as a dict; None when they are not a JSON object."""
    try:
        args = json.loads(call.get("function", {}).get("arguments") or "{}")
    except (TypeError, ValueError, RecursionError):  # RecursionError: "[[[[..." nested past json's limit
        return None
    return args if isinstance(args, dict) else None


def function_tool(name: str, description: str, arg: str, example: str) -> dict:
    """An OpenAI function-tool schema taking one required string argument `arg`: the shape
    every tool of this package has (calculator, python)."""
    return {"type": "function",
            "function": {"name": name, "description": description,
                         "parameters": {"type": "object", "properties": {arg: {"type": "string", "description": example}},
                                        "required": [arg]}}}

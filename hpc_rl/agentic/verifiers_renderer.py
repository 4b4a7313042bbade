"""A verifiers renderer for models that write pythonic tool calls (`[check(answer="7")]`, vLLM's
`pythonic` tool parser, the tiny models' format): runs in the verifiers virtualenv, never
imported by hpc_rl (the standard library and verifiers' `renderers` package only).

verifiers renders prompts and parses replies with its `renderers` package. Its tool parsers
(`qwen3`, `qwen3.5`, `glm`, `deepseek-v3`) read special tokens; a model whose tool calls are
plain text has none, and the default renderer without a parser refuses tools ("DefaultRenderer
does not support tools"). This is the renderer that `env.agentic.verifiers.renderer: pythonic`
names: renderers' own `DefaultRenderer` (the tokenizer's chat template) with a pythonic tool
parser, loaded through renderers' public custom-renderer hook
(`{"name": "custom", "import_path": "<this file>:PythonicRenderer"}`).
"""

from __future__ import annotations

import ast
import json

from renderers.base import ParsedToolCall, ToolCallParseStatus
from renderers.configs import DefaultRendererConfig
from renderers.default import DefaultRenderer

MAX_CHARS = 20000  # a reply longer than this is not parsed as calls (ast's depth and time)


def _literal(node):
    return ast.literal_eval(node)


def parse_pythonic(text: str) -> list:
    """The calls of a reply that is one pythonic list `[f(a=1), g(b="x")]`; [] when the reply
    does not start with `[` (plain content); one MALFORMED_STRUCTURE record when it does but
    does not parse."""
    body = text.strip()
    if not body.startswith("["):
        return []
    try:
        if len(body) > MAX_CHARS:
            raise ValueError("too long")
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ValueError("not a list of calls")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise ValueError("not name(key=value, ...)")
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
            json.dumps(args)  # JSON-able, as a tool's arguments must be
            calls.append(ParsedToolCall(raw=ast.get_source_segment(body, node) or body, name=node.func.id,
                                        arguments=args, status=ToolCallParseStatus.OK))
        return calls
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return [ParsedToolCall(raw=body[:2000], status=ToolCallParseStatus.MALFORMED_STRUCTURE)]


class PythonicToolParser:
    """renderers' ToolParser protocol over the decoded reply: (content ids, calls)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def extract(self, ids):
        """The reply stays the content (what the policy wrote, so a template that renders
        content alone renders the same tokens again), its calls beside it."""
        return list(ids), parse_pythonic(self._tokenizer.decode(ids, skip_special_tokens=True))


def _call_text(call: dict) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = {}
    inner = ", ".join(f"{k}={json.dumps(v)}" for k, v in (args.items() if isinstance(args, dict) else ()))
    return f"{fn.get('name', '')}({inner})"


def with_content(messages: list) -> list:
    """Messages a content-only chat template can render: an assistant message holding tool
    calls and no content gets the calls' pythonic text; a missing content is ""."""
    out = []
    for m in messages:
        if m.get("content") is None or (m.get("role") == "assistant" and m.get("tool_calls") and not m.get("content")):
            m = dict(m)
            calls = m.get("tool_calls") or []
            m["content"] = f"[{', '.join(_call_text(c) for c in calls)}]" if calls else ""
        out.append(m)
    return out


class PythonicRenderer(DefaultRenderer):
    """The tokenizer's chat template (renderers' DefaultRenderer) with pythonic tool calls."""

    config_class = DefaultRendererConfig

    def __init__(self, tokenizer, config=None):
        super().__init__(tokenizer, config)
        self._tool_parser = PythonicToolParser(tokenizer)

    def _apply(self, messages, **kwargs):
        return super()._apply(with_content(messages), **kwargs)

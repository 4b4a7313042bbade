"""The rules of the config reference (config/reference.py): every `Violation(...)`,
`Refusal(...)` and `check_positive(...)` call of RULE_SOURCES, read with ast, as a `Check` on
the key patterns it names (a role section's `{key}` expands to the sections its function
checks, a loop over constants to each value); texts only the failing config knows stay
`{placeholders}`."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

PACKAGE = Path(__file__).resolve().parents[1]

# Files whose violations name keys, and what a violation there means.
RULE_SOURCES: List[Tuple[str, str]] = [
    ("config/validate.py", "checked"),
    ("config/validate_generator.py", "checked"),
    ("config/validate_async.py", "checked"),
    ("config/validate_packing.py", "checked"),
    ("config/validate_lora.py", "checked"),
    ("config/validate_logging.py", "checked"),
    ("config/validate_agentic.py", "checked"),
    ("config/validate_rundir.py", "checked"),
    ("config/validate_ft.py", "checked"),
    ("config/validate_data.py", "checked"),
    ("config/validate_algo.py", "checked"),
    ("config/validate_dynamic_sampling.py", "checked"),
    ("config/validate_memory.py", "checked"),
    ("config/validate_memory_plan.py", "checked"),
    ("rl/inputs.py", "inputs"),
    ("rl/heldout.py", "inputs"),
    ("engines/vllm_args.py", "inputs"),
    ("slurm/preflight.py", "cluster"),
    ("config/support.py", "refused"),
    ("config/support_memory.py", "refused"),
    # each model family's refusals (models/families/<name>/), reported by rl/inputs.py
    *((str(p.relative_to(PACKAGE)), "inputs") for p in sorted((PACKAGE / "models" / "families").glob("*/__init__.py"))),
]
# `{key}` at the start of a violation's key names a role section; these functions name fewer.
ROLE_KEYS = ("trainer", "generator", "teachers.*", "env")
ROLE_KEYS_OF = {"_parallel_combinations": ("trainer", "teachers.*"), "_check_family_parallel": ("trainer", "teachers.*")}


@dataclass
class Check:
    kind: str
    pattern: str  # fnmatch pattern over dotted keys ('*': any dict entry, loop value, ...)
    problem: str
    fix: str
    where: str  # file:function, for the reader who wants the code


def display_key(path: str) -> str:
    """A dotted key as the page shows it: a dict section's entries (`*`) as `<alias>`."""
    return path.replace("*", "<alias>")


class _Calls(ast.NodeVisitor):
    """Violation(key, value, problem, fix) and check_positive(out, key, value[, minimum]) calls."""

    def __init__(self, kind: str, where: str) -> None:
        self.kind, self.where = kind, where
        self.func = ""
        self.strings: Dict[str, ast.expr] = {}  # the function's names bound to (f-)strings
        self.loops: List[Dict[str, List[str]]] = []
        self.found: List[Check] = []

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        saved = self.func, self.strings
        self.func = node.name
        self.strings = {t.id: s.value for s in ast.walk(node) if isinstance(s, ast.Assign)
                        and isinstance(s.value, (ast.JoinedStr, ast.Constant)) for t in s.targets if isinstance(t, ast.Name)}
        self.generic_visit(node)
        self.func, self.strings = saved

    def visit_For(self, node: ast.For) -> None:
        elts = node.iter.elts if isinstance(node.iter, (ast.Tuple, ast.List)) else []
        known = isinstance(node.target, ast.Name) and elts and all(isinstance(e, ast.Constant) for e in elts)
        self.loops.append({node.target.id: [str(e.value) for e in elts]} if known else {})
        self.generic_visit(node)
        self.loops.pop()

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.id if isinstance(node.func, ast.Name) else ""

        def arg(i: int, kw: str) -> Optional[ast.expr]:
            return node.args[i] if len(node.args) > i else next((k.value for k in node.keywords if k.arg == kw), None)

        if name in ("Violation", "Refusal") and arg(3, "fix") is not None:
            key, problem, fix = self.patterns(arg(0, "key")), self.text(arg(2, "problem")), self.text(arg(3, "fix"))
        elif name == "check_positive" and arg(1, "key") is not None:
            low = arg(3, "minimum")
            least = low.value if isinstance(low, ast.Constant) else 1
            key, problem, fix = self.patterns(arg(1, "key")), f"must be an integer >= {least}", f"set it to {least} or more"
        else:
            key = None
        for pattern, subs in key or []:
            problem_, fix_ = (_fill(t, subs) for t in (problem, fix))
            self.found.append(Check(self.kind, re.sub(r"\[\*\]$", "", pattern), problem_, fix_, f"{self.where}:{self.func}"))
        self.generic_visit(node)

    def patterns(self, node: Optional[ast.expr], first: bool = True) -> Optional[List[Tuple[str, Dict[str, str]]]]:
        """The keys a key expression names, each with the values it gave the expression's
        names; None when the key is a variable only the runtime knows."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [(node.value, {})]
        if isinstance(node, ast.Name) and node.id in self.strings:
            return self.patterns(self.strings[node.id], first)
        if not isinstance(node, ast.JoinedStr):
            return None
        outs: List[Tuple[str, Dict[str, str]]] = [("", {})]
        for part in node.values:
            opts = [(part.value, {})] if isinstance(part, ast.Constant) else self._expand(part.value, first and outs == [("", {})])
            outs = [(o + p, {**so, **sp}) for o, so in outs for p, sp in opts]
        return outs

    def _expand(self, value: ast.expr, at_start: bool) -> List[Tuple[str, Dict[str, str]]]:
        if isinstance(value, ast.Name):
            if value.id in self.strings:
                return self.patterns(self.strings[value.id], at_start) or [("*", {})]
            for loop in reversed(self.loops):
                if value.id in loop:
                    return [(v, {value.id: v}) for v in loop[value.id]]
            if value.id == "key" and at_start:
                return [(k, {"key": display_key(k)}) for k in ROLE_KEYS_OF.get(self.func, ROLE_KEYS)]
        return [("*", {})]

    def text(self, node: Optional[ast.expr]) -> str:
        if isinstance(node, ast.Constant):
            return str(node.value)
        if isinstance(node, ast.Name) and node.id in self.strings:
            return self.text(self.strings[node.id])
        if isinstance(node, ast.JoinedStr):
            return "".join(p.value if isinstance(p, ast.Constant) else _placeholder(p.value) for p in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.text(node.left) + self.text(node.right)
        if isinstance(node, ast.IfExp):
            return f"{self.text(node.body)}; otherwise {self.text(node.orelse)}"
        return _placeholder(node) if node is not None else ""


def _fill(text: str, subs: Dict[str, str]) -> str:
    for name, value in subs.items():
        text = text.replace("{" + name + "}", value)
    return text


def _placeholder(expr: ast.expr) -> str:
    """A value only the failing config knows: `{name}` where short, `{...}` otherwise."""
    src = ast.unparse(expr)
    return "{error}" if src.startswith("str(e") else "{" + (src if len(src) <= 32 else "...") + "}"


def source_checks() -> List[Check]:
    out: List[Check] = []
    for rel, kind in RULE_SOURCES:
        visitor = _Calls(kind, f"hpc_rl/{rel}")
        visitor.visit(ast.parse((PACKAGE / rel).read_text()))
        out += visitor.found
    return out

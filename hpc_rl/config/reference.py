"""The config reference (docs/reference/config.md), generated from one source: the schema.

    python -m hpc_rl.config.reference --write    # regenerate the page
    python -m hpc_rl.config.reference            # print it
    python -m hpc_rl.config.reference --check    # exit 1 when the page is stale

A key's type and default come from the dataclasses of schema.py; its meaning from the class
docstrings and the `# comments` on a field's line or on the lines right above it (read with
ast and tokenize, so the comments stay the one place to document a key); the rules that
check it from the `Violation(...)` and `check_positive(...)` calls of RULE_SOURCES (read with
ast); the refusals of this version from support.RULES and support.FACTS.
tests/test_config_reference.py fails when the page differs from what this module writes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import io
import json
import re
import sys
import tokenize
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import schema, support
from .keys import _entry_type
from .schema import RunConfig

PACKAGE = Path(__file__).resolve().parents[1]
PAGE = PACKAGE.parent / "docs" / "reference" / "config.md"
REGENERATE = "python -m hpc_rl.config.reference --write"

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
    *((str(p.relative_to(Path(__file__).resolve().parents[1])), "inputs")
      for p in sorted((Path(__file__).resolve().parents[1] / "models" / "families").glob("*/__init__.py"))),
]
KINDS = {
    "checked": "checked by validation on every launch, the dry run included (exit 2, nothing submitted)",
    "inputs": "checked before any rank starts (launcher=local|slurm and `--batch-plan`): checkpoints, data, "
              "routing, loggers",
    "cluster": "checked against the live cluster before submitting (launcher=slurm)",
    "refused": "refused by this version for real launches (launcher=local|slurm, hand-submitted scripts); the dry "
               "run plans the config and lists the refusal",
    "fact": "describes the machines or the model; validation checks the plan against it",
}
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


@dataclass
class Key:
    path: str  # dotted; '*' for the entries of a dict section (teachers.*.checkpoint)
    type: str
    default: Any
    doc: str
    section: bool = False
    checks: List[Check] = field(default_factory=list)


# -- meaning: docstrings and comments of schema.py -----------------------------------------


def field_docs(source: str) -> Tuple[Dict[str, str], Dict[Tuple[str, str], Tuple[str, str]]]:
    """(class -> docstring, (class, field) -> (annotation, comment)) of a schema source. A
    field's comment is the comment lines right above it joined with its trailing comment."""
    tree = ast.parse(source)
    lines = source.splitlines()
    notes = {tok.start[0]: tok.string.lstrip("#").strip()
             for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    aliases = {t.id: ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Name)}
    docs: Dict[str, str] = {}
    fields: Dict[Tuple[str, str], Tuple[str, str]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        docs[cls.name] = ast.get_docstring(cls) or ""
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: List[str] = []
            row = stmt.lineno - 1
            while row >= 1 and lines[row - 1].strip().startswith("#"):
                above.insert(0, notes[row])
                row -= 1
            trailing = notes.get(stmt.end_lineno) if not lines[stmt.end_lineno - 1].strip().startswith("#") else None
            ann = ast.unparse(stmt.annotation)
            fields[(cls.name, stmt.target.id)] = (aliases.get(ann, ann), " ".join(above + ([trailing] if trailing else [])))
    return docs, fields


def schema_keys(root: type = RunConfig, source: Optional[str] = None) -> List[Key]:
    """Every section and leaf key of the schema, in field order, with its type, default and meaning."""
    if source is None:  # schema.py and the sections kept beside it (schema_agentic.py)
        source = "\n".join(p.read_text() for p in sorted(Path(schema.__file__).parent.glob("schema*.py")))
    docs, fields = field_docs(source)

    def doc_of(cls: type, name: str) -> Tuple[str, str]:
        found = [fields[(k.__name__, name)] for k in cls.__mro__ if (k.__name__, name) in fields]
        return (found[0][0] if found else "?"), next((c for _, c in found if c), "")

    def walk(cls: type, prefix: str) -> List[Key]:
        out: List[Key] = []
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            ann, comment = doc_of(cls, f.name)
            tp = hints[f.name]
            sub = _entry_type(tp) or (tp if dataclasses.is_dataclass(tp) else None)
            if sub is not None:
                own = docs.get(sub.__name__, "")
                out.append(Key(prefix + f.name, ann, None, " ".join(d for d in (comment, own) if d), section=True))
                out += walk(sub, prefix + f.name + (".*." if _entry_type(tp) else "."))
            else:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                out.append(Key(prefix + f.name, ann, default, comment))
        return out

    return walk(root, "")


# -- rules: the violations that name keys ------------------------------------------------


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
                return [(k, {"key": _display(k)}) for k in ROLE_KEYS_OF.get(self.func, ROLE_KEYS)]
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


def refusal_checks() -> List[Check]:
    """support.RULES (the refusals, their texts as the runtime prints them) and support.FACTS."""
    out = []
    for rule in support.RULES:
        when = f"for run.program={'|'.join(rule.programs)}, e.g. {rule.key}={_show(rule.example)}: "
        out.append(Check("refused", rule.key, when + rule.problem, rule.fix.format(key=_display(rule.key)),
                         "hpc_rl/config/support.py:RULES"))
    out += [Check("fact", f.key, f.use, "", "hpc_rl/config/support.py:FACTS") for f in support.FACTS]
    return out


def attach(keys: Sequence[Key], checks: Sequence[Check]) -> List[Check]:
    """Give every check to the keys its pattern names; returns the checks that named none."""
    lost = []
    for check in checks:
        for pattern in (check.pattern, re.sub(r"\.\*$", "", check.pattern)):
            hits = [k for k in keys if fnmatch.fnmatchcase(k.path, pattern)]
            if hits:
                break
        for k in hits:
            if check not in k.checks:
                k.checks.append(check)
        if not hits:
            lost.append(check)
    return lost


# -- the page ------------------------------------------------------------------------------


def _display(path: str) -> str:
    return path.replace("*", "<alias>")


def _show(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, dict, tuple)):
        return json.dumps(value)
    return repr(value)


def _md(text: str) -> str:
    """Plain text as Markdown: code spans kept, the characters Markdown would act on escaped."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") and p.endswith("`") and len(p) > 1 else
                   re.sub(r"[\\*\[\]]|(?<!\w)_|_(?!\w)", lambda m: "\\" + m.group(0), p).replace("<", "&lt;") for p in parts)


def _check_line(check: Check) -> str:
    fix = f" Fix: {_md(check.fix)}" if check.fix else ""
    return f"- **{check.kind}**: {_md(check.problem)}.{fix} <small>(`{check.where}`)</small>"


INTRO = f"""# Config reference

<!-- Generated from hpc_rl/config/schema.py and the rules that check it by
     `{REGENERATE}`; edit those, not this page. -->

Every key of the schema, in the order of `hpc_rl/config/schema.py`, with its type, its
default, what it means (the schema's own comments), the rules that check it and whether this
version refuses it. Set a key on the command line (`trainer.nodes=32`), in a recipe
(`recipes/recipe/*.yaml`) or in a group file (`cluster=h100`); `--show-config` prints every
key of a composed config. `<alias>` stands for an entry of `teachers` (e.g. `teachers.math`).

The kinds of rules:

{chr(10).join(f"- **{k}**: {v}" for k, v in KINDS.items())}

A key with no **refused** line is honoured: `tests/test_config_keys.py` checks that the
runtime reads every key that is neither refused nor a fact. Texts in braces (`{{tp}}`) are
filled in from the failing config. Regenerate this page with `{REGENERATE}`;
`tests/test_config_reference.py` fails when it is stale.
"""


def render(keys: Sequence[Key]) -> str:
    out = [INTRO]
    top = [k for k in keys if "." not in k.path]
    out.append("\n## Top level\n")
    for key in top:
        if not key.section:
            out.append(_key_block(key))
    for key in keys:
        if key.section and "." not in key.path:
            out.append(f"\n## `{key.path}`\n")
            out.append(_section_text(key))
        elif key.section:
            out.append(f"\n**`{_display(key.path)}`** (`{key.type}`)" + (f": {_md(key.doc)}" if key.doc else "") + "\n")
            out += [_check_line(c) for c in key.checks]
        elif "." in key.path:
            out.append(_key_block(key))
    return "\n".join(out).rstrip() + "\n"


def _section_text(key: Key) -> str:
    lines = [_md(key.doc) + "\n"] if key.doc else []
    lines += [_check_line(c) for c in key.checks]
    return "\n".join(lines)


def _key_block(key: Key) -> str:
    kinds = {c.kind for c in key.checks}
    status = ("refused by this version in the cases below" if "refused" in kinds else
              "a fact: validation checks the plan against it" if "fact" in kinds else "honoured by this version")
    lines = [f"\n### `{_display(key.path)}`\n", f"`{key.type}` · default `{_show(key.default)}` · {status}\n"]
    if key.doc:
        lines.append(_md(key.doc) + "\n")
    lines += [_check_line(c) for c in key.checks]
    return "\n".join(lines)


def generate() -> Tuple[str, List[Check]]:
    """The page, and the checks whose key names nothing in the schema (should be none)."""
    keys = schema_keys()
    lost = attach(keys, source_checks() + refusal_checks())
    return render(keys), lost


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpc_rl.config.reference", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {PAGE}")
    ap.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    args = ap.parse_args(argv)
    page, lost = generate()
    for check in lost:
        print(f"warning: {check.where}: key {check.pattern!r} names no schema key", file=sys.stderr)
    if args.write:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(page)
        print(f"wrote {PAGE}")
    elif args.check:
        stale = not PAGE.exists() or PAGE.read_text() != page
        print(f"{PAGE} is {'stale: run ' + REGENERATE if stale else 'current'}")
        return 1 if stale else 0
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The config reference (docs/reference/config.md), generated from one source: the schema.

    python -m hpc_rl.config.reference --write    # regenerate the page
    python -m hpc_rl.config.reference            # print it
    python -m hpc_rl.config.reference --check    # exit 1 when the page is stale

A key's type and default come from the dataclasses of schema.py; its meaning from the class
docstrings and the `# comments` on a field's line or on the lines right above it (read with
ast and tokenize, so the comments stay the one place to document a key); the rules that
check it from the `Violation(...)` and `check_positive(...)` calls of RULE_SOURCES (read with
ast: reference_rules.py); the refusals of this version from support.RULES and support.FACTS.
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
from .reference_rules import PACKAGE, Check, display_key, source_checks
from .schema import RunConfig

PAGE = PACKAGE.parent / "docs" / "reference" / "config.md"
REGENERATE = "python -m hpc_rl.config.reference --write"

KINDS = {
    "checked": "checked by validation on every launch, the dry run included (exit 2, nothing submitted)",
    "inputs": "checked before any rank starts (launcher=local|slurm and `--batch-plan`): checkpoints, data, "
              "routing, loggers",
    "cluster": "checked against the live cluster before submitting (launcher=slurm)",
    "refused": "refused by this version for real launches (launcher=local|slurm, hand-submitted scripts); the dry "
               "run plans the config and lists the refusal",
    "fact": "describes the machines or the model; validation checks the plan against it",
}


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


# -- rules: the violations that name keys (reference_rules.py), the refusals --------------


def refusal_checks() -> List[Check]:
    """support.RULES (the refusals, their texts as the runtime prints them) and support.FACTS."""
    out = []
    for rule in support.RULES:
        when = f"for run.program={'|'.join(rule.programs)}, e.g. {rule.key}={_show(rule.example)}: "
        out.append(Check("refused", rule.key, when + rule.problem, rule.fix.format(key=display_key(rule.key)),
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
            out.append(f"\n**`{display_key(key.path)}`** (`{key.type}`)" + (f": {_md(key.doc)}" if key.doc else "") + "\n")
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
    lines = [f"\n### `{display_key(key.path)}`\n", f"`{key.type}` · default `{_show(key.default)}` · {status}\n"]
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

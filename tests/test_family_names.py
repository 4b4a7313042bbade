"""A model family is one place (issue 46): no architecture class name (`LlamaForCausalLM`, ...)
and no family model_type string (`"nemotron_h"`, ...) appears in hpc_rl/ outside
hpc_rl/models/families/. Core code asks the registry (families.of_config / named) instead.

Class names are looked for anywhere in a file (code, comments, docstrings); model_type values
as whole string constants and as the literal parts of f-strings (prose such as "a Nemotron-H"
and identifiers such as tiny_nemotron stay free). Generated docs are outside hpc_rl/. A line
that uses such a string for something else (a tool parser named like a model) says so with
`# family-name-ok: <why>`."""

import ast
import re
from pathlib import Path
from typing import List

from hpc_rl.models import families

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hpc_rl"
OWN = PACKAGE / "models" / "families"


def _names():
    classes = {a for f in families.FAMILIES for a in f.architectures}
    types = {t for f in families.FAMILIES for t in f.all_model_types}
    return classes, types


def violations(root: Path = PACKAGE) -> List[str]:
    classes, types = _names()
    class_re = re.compile(r"\b(" + "|".join(map(re.escape, sorted(classes))) + r")\b")
    out = []
    for path in sorted(root.rglob("*.py")):
        if OWN in path.parents:
            continue
        text = path.read_text()
        rel = path.relative_to(root.parent)
        lines = text.splitlines()
        for m in class_re.finditer(text):
            out.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: architecture name {m.group(1)}")
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in types
                    and "# family-name-ok" not in lines[node.lineno - 1]):
                out.append(f"{rel}:{node.lineno}: model_type string {node.value!r}")
    return out


def test_no_family_name_outside_the_families():
    found = violations()
    assert not found, ("family names outside hpc_rl/models/families/ (ask the registry, "
                       "hpc_rl.models.families, instead):\n  " + "\n  ".join(found))


def test_the_check_sees_a_planted_name(tmp_path):
    """The check fails on a name planted outside the families (the test can fail)."""
    planted = tmp_path / "hpc_rl" / "core.py"
    planted.parent.mkdir()
    planted.write_text('ARCH = "nemotron_h"\n# loads a Qwen2ForCausalLM\n')
    found = violations(tmp_path / "hpc_rl")
    assert len(found) == 2 and "model_type string 'nemotron_h'" in found[0] + found[1]

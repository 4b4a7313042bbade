"""Import-circle checks the tests share: every module a file imports, top level or inside a
function (a lazy import back is a circle too)."""

import ast
from pathlib import Path
from typing import List


def imported_modules(path: Path) -> List[str]:
    out: List[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out += [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out

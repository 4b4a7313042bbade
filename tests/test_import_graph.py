"""No import circle inside hpc_rl/ (issue 46): every `import` and `from ... import` of a module
counts, at module level or inside a function (a lazy import still makes the two modules need
each other), TYPE_CHECKING blocks included. A registry sits above what it registers, a protocol
below its implementations."""

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]


def import_graph(src_root: Path, package: str) -> Dict[str, Set[str]]:
    """module -> the package's modules it imports (a `from pkg import name` of a submodule counts
    as that submodule)."""
    mods = {}
    for p in (src_root / package).rglob("*.py"):
        parts = p.relative_to(src_root).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph: Dict[str, Set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                deps |= {f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_hpc_rl_has_no_import_circle():
    graph = import_graph(ROOT, "hpc_rl")
    assert len(graph) > 200  # the walk saw the package
    found = circles(graph)
    assert not found, "import circles inside hpc_rl/ (break each: move the shared piece below both, " \
                      "or the registry above what it registers):\n" + "\n".join(" -> ".join(c) for c in found)


def test_a_planted_circle_is_found(tmp_path):
    pkg = tmp_path / "planted"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from planted.c import g\n")  # a lazy import counts
    (pkg / "c.py").write_text("import planted.a\n\ndef g():\n    pass\n")
    (pkg / "d.py").write_text("from planted import a\n")  # imports into the circle, not part of it
    assert circles(import_graph(tmp_path, "planted")) == [["planted.a", "planted.c", "planted.sub.b"]]

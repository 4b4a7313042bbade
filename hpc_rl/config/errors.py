"""One config error that lists every violation, each naming the key, the value and a fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List


@dataclass(frozen=True)
class Violation:
    key: str  # dotted path, e.g. trainer.parallel.ep
    value: Any
    problem: str
    fix: str

    def render(self) -> str:
        return f"{self.key} = {self.value!r}: {self.problem}\n      fix: {self.fix}"


class ConfigError(Exception):
    """Raised with every violation found; the launcher exits 2 and submits nothing."""

    exit_code = 2

    def __init__(self, violations: Iterable[Violation]):
        self.violations: List[Violation] = list(violations)
        super().__init__(self.render())

    def render(self) -> str:
        n = len(self.violations)
        head = f"invalid config: {n} problem{'s' if n != 1 else ''}; nothing was submitted"
        body = "\n".join(f"  - {v.render()}" for v in self.violations)
        return f"{head}\n{body}"


def check_positive(out: List[Violation], key: str, value, minimum: int = 1) -> bool:
    """Appends a violation unless `value` is an integer >= `minimum`; says whether it was."""
    if value is None or value < minimum:
        out.append(Violation(key, value, f"must be at least {minimum}", f"set {key} to an integer >= {minimum}"))
        return False
    return True

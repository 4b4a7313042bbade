"""TEST-ONLY. A user's own tool-using environments for tests/test_byoe.py (issue 48), written the
way a newcomer writes them (docs/byoe.md): outside the repository, against the library's
public API only, not copies of the project's examples. `write_verifiers_taskset(dir)` writes
a verifiers 0.4.0 package (taskset `vf-calc`, one tool server with one tool,
`calculator(expression)`, at most two calls an episode; `broken_tool: true` plants a tool
that raises) and returns its directory."""

from __future__ import annotations

from pathlib import Path

PYPROJECT = '''[project]
name = "vf-calc"
version = "0.1.0"
requires-python = ">=3.10"
dependencies = ["verifiers==0.4.0"]

[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[tool.setuptools]
packages = ["vf_calc"]
'''

INIT = '''from vf_calc.taskset import CalcTask, CalcTaskset, CalcTasksetConfig

__all__ = ["CalcTask", "CalcTaskset", "CalcTasksetConfig"]
'''

TOOLS = '''"""calculator(expression): `a op b` for two integers, at most `max_calls` calls an episode."""

import re

import verifiers.v1 as vf

_EXPR = re.compile(r"\\s*(-?\\d{1,9})\\s*([-+*])\\s*(-?\\d{1,9})\\s*")


class CalcConfig(vf.ToolsetConfig):
    max_calls: int = 2
    broken: bool = False


class CalcTools(vf.Toolset[CalcConfig]):
    calls = 0

    @vf.tool
    async def calculator(self, expression: str) -> str:
        """Compute `a op b` for two integers a and b, op one of + - *."""
        if self.config.broken:
            raise RuntimeError("planted: this tool is broken")
        self.calls += 1
        if self.calls > self.config.max_calls:
            return "no more calls"
        m = _EXPR.fullmatch(expression)
        if m is None:
            return "not a op b"
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        return str(a + b if op == "+" else a - b if op == "-" else a * b)


if __name__ == "__main__":
    CalcTools.run()
'''

TASKSET = '''import random

import verifiers.v1 as vf

from vf_calc.tools import CalcConfig, CalcTools


class CalcData(vf.TaskData):
    answer: str


class CalcTaskConfig(vf.TaskConfig):
    tools: CalcConfig = CalcConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcTools(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class CalcTasksetConfig(vf.TasksetConfig):
    num_tasks: int = 64
    broken_tool: bool = False


class CalcTaskset(vf.Taskset[CalcTask, CalcTasksetConfig]):
    def load(self) -> list[CalcTask]:
        rng = random.Random(0)
        config = CalcTaskConfig(tools=CalcConfig(broken=self.config.broken_tool))
        out = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(10, 99), rng.randint(2, 9)
            out.append(CalcTask(CalcData(id=f"calc-{i}", prompt=f"What is {a} times {b}?", answer=str(a * b)), config))
        return out
'''


def write_verifiers_taskset(root: Path) -> Path:
    pkg = root / "vf_calc"
    (pkg / "vf_calc").mkdir(parents=True, exist_ok=True)
    (pkg / "pyproject.toml").write_text(PYPROJECT)
    for name, text in (("__init__.py", INIT), ("tools.py", TOOLS), ("taskset.py", TASKSET)):
        (pkg / "vf_calc" / name).write_text(text)
    return pkg

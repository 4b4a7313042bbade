"""Arithmetic questions in the shape the tiny hpc_rl models were trained on ("What is 3 plus
5?", "What is 7 times 4?"), scored by a rubric of two weighted rewards: the exact answer
(weight 1.0) and a format reward for a reply that is one integer (weight 0.1), so a policy
that answers in the right shape but wrongly still gets a signal GRPO can rank.

Public verifiers API only: vf.TaskData, vf.Task, vf.Taskset, vf.TasksetConfig, vf.reward,
vf.Trace.last_reply.
"""

from __future__ import annotations

import operator
import random
import re

import verifiers.v1 as vf

OPS = {"plus": operator.add, "times": operator.mul}
_INT = re.compile(r"\s*[-+]?\d+\s*")


class ArithData(vf.TaskData):
    answer: str
    """The product, as text."""


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        reply = trace.last_reply.strip()
        return float(bool(_INT.fullmatch(reply)) and int(reply) == int(self.data.answer))

    @vf.reward(weight=0.1)
    async def one_integer(self, trace: vf.Trace) -> float:
        return float(bool(_INT.fullmatch(trace.last_reply)))


class ArithTasksetConfig(vf.TasksetConfig):
    num_tasks: int = 512
    """How many questions to build."""
    operation: str = "plus"
    """`plus` or `times`."""
    low: int = 0
    """The smallest operand."""
    high: int = 9
    """The largest operand."""
    seed: int = 0
    """The questions' random seed: the same seed, the same tasks."""


class ArithTaskset(vf.Taskset[ArithTask, ArithTasksetConfig]):
    def load(self) -> list[ArithTask]:
        c = self.config
        if c.operation not in OPS:
            raise ValueError(f"operation must be one of {sorted(OPS)}, not {c.operation!r}")
        rng = random.Random(c.seed)
        tasks = []
        for i in range(c.num_tasks):
            a, b = rng.randint(c.low, c.high), rng.randint(c.low, c.high)
            data = ArithData(id=f"tiny-arith-{i}", prompt=f"What is {a} {c.operation} {b}?", answer=str(OPS[c.operation](a, b)))
            tasks.append(ArithTask(data, self.config.task))
        return tasks

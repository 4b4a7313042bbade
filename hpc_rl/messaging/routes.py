"""Who sends a step's data to whom: the exchange plan, pure data from the job plan.

Data moves along its route, producer to consumer, never as a world-wide broadcast per
producer (at `ultra_mopd`'s shape that would be 512 generator broadcasts per step, each to
about 860 ranks). One step:

  driver (trainer rank 0) --order--> each generator rank           prompts and seeds of its share
  generator g --rows--> its env rank, every teacher group's head    the samples each one scores
  generator g --rows--> driver                                      sampled rows, weight version
  env e, teacher head t --scores--> driver                          rewards, teacher logprobs
  driver --batch--> the trainer role group (one group broadcast)
  teacher head --rows--> its teacher role group (one group broadcast)

So a rank's messages per step grow with its own producers and consumers, not with the
world size. `bench/exchange.py` counts them from this plan for the flagship's shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from hpc_rl.plan.job_plan import JobPlan
from hpc_rl.runtime.identity import role_offsets

TRAINER = 0  # the trainer is always the plan's first role


@dataclass(frozen=True)
class Routes:
    """Global ranks of every role, and who feeds whom."""

    trainer: List[int]
    generators: List[int]  # one per engine: the global rank of its first task
    envs: List[int]
    teachers: Dict[str, List[int]] = field(default_factory=dict)  # teacher group -> its ranks (first is the head)
    engine_tasks: int = 1  # generator tasks per engine; `generators` lists each engine's first

    def leads_engine(self, generator_role_rank: int) -> bool:
        return generator_role_rank % self.engine_tasks == 0

    @classmethod
    def from_plan(cls, plan: JobPlan) -> "Routes":
        offsets = role_offsets(plan)

        def ranks(role: str) -> List[int]:
            first, n = offsets.get(role, (0, 0))
            return list(range(first, first + n))

        teachers = {r.name.split("/", 1)[1]: ranks(r.name) for r in plan.roles if r.name.startswith("teacher/")}
        # an engine spanning several generator tasks is served by its first (engines/spanning.py)
        per_engine = plan.role("generator").tasks_per_replica if "generator" in offsets else 1
        return cls(ranks(plan.roles[TRAINER].name), ranks("generator")[::per_engine], ranks("env"), teachers, per_engine)

    @property
    def driver(self) -> int:
        return self.trainer[0]

    def teacher_head(self, group: str) -> int:
        return self.teachers[group][0]

    def env_of(self, generator_index: int) -> int | None:
        """The env rank that scores generator `generator_index`'s rows (round robin). With
        more env ranks than generators the surplus env ranks stay idle."""
        return self.envs[generator_index % len(self.envs)] if self.envs else None

    def generators_of_env(self, env_rank: int) -> List[int]:
        """Generator indices whose rows `env_rank` scores."""
        return [g for g in range(len(self.generators)) if self.env_of(g) == env_rank]

    def step_messages(self) -> List[Tuple[str, int, int]]:
        """Every object message of one steady training step as (what, src, dst), the way
        the loop sends them; a group broadcast counts one message per receiving member.
        (Checkpoint steps add one trainer-group flag; evaluations are not steps.)"""
        out: List[Tuple[str, int, int]] = []
        d = self.driver
        for g, gr in enumerate(self.generators):
            out.append(("order", d, gr))  # a training order implies the refit that follows
            e = self.env_of(g)
            if e is not None:
                out.append(("rows", gr, e))
            out += [("rows", gr, self.teacher_head(t)) for t in self.teachers]
            out.append(("rows", gr, d))
        out += [("rewards", e, d) for e in self.envs if self.generators_of_env(e)]
        for t, ranks in self.teachers.items():
            out.append(("teacher_logprobs", ranks[0], d))
            out += [("group:rows", ranks[0], r) for r in ranks[1:]]
        for what in ("group:rows", "group:scores"):  # the rows' share also carries a stop
            out += [(what, d, r) for r in self.trainer[1:]]
        return out

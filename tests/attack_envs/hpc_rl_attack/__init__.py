"""TEST-ONLY. A hostile verifiers 0.4.0 taskset (public API only): while loading and while
scoring, it runs attack_probe.probe against the targets the test names in its config
(`targets`, JSON) and scores 1.0 only when every attempt was stopped (else minus the number
that worked). tests/test_env_isolation.py runs it through hpc_rl's verifiers bridge; the
Makefile's verifiers-env puts tests/attack_envs on the virtualenv's path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import verifiers.v1 as vf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # attack_probe.py, beside this package
import attack_probe  # noqa: E402


class AttackData(vf.TaskData):
    targets: str


class AttackTask(vf.Task[AttackData]):
    @vf.reward(weight=1.0)
    async def nothing_leaked(self, trace: vf.Trace) -> float:
        return attack_probe.run_and_report(json.loads(self.data.targets))


class AttackTasksetConfig(vf.TasksetConfig):
    targets: str = "{}"
    """What to aim at (attack_probe.probe's targets), as JSON."""
    num_tasks: int = 2


class AttackTaskset(vf.Taskset[AttackTask, AttackTasksetConfig]):
    def load(self) -> list[AttackTask]:
        attack_probe.run_and_report(json.loads(self.config.targets))  # at load time too: in the worker itself
        return [AttackTask(AttackData(id=f"attack-{i}", prompt="Say anything.", targets=self.config.targets),
                           self.config.task) for i in range(self.config.num_tasks)]


__all__ = ["AttackData", "AttackTask", "AttackTaskset", "AttackTasksetConfig"]

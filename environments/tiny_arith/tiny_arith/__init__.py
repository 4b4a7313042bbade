"""tiny-arith: a verifiers 0.4.0 environment written against its public API only
(`import verifiers.v1 as vf`), for the tiny assets of hpc_rl.

Taskset id `tiny-arith` (module `tiny_arith`); no Env is exported, so verifiers pairs it
with its default `SingleAgentEnv`: one agent answers each task through its harness.
"""

from tiny_arith.taskset import ArithData, ArithTask, ArithTaskset, ArithTasksetConfig

__all__ = ["ArithData", "ArithTask", "ArithTaskset", "ArithTasksetConfig"]

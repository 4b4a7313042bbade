"""The seams of the RL loop: the backend and engine registries agree with the schema, and
the routed exchange keeps a rank's messages per step independent of the world size."""

from __future__ import annotations

import typing
from collections import Counter

from hpc_rl.config.schema import GeneratorConfig, TrainerConfig
from hpc_rl.engines.registry import ENGINES
from hpc_rl.models.registry import BACKENDS
from hpc_rl.messaging.routes import Routes


def _literal(cls, name):
    return set(typing.get_args(typing.get_type_hints(cls)[name]))


def test_every_backend_the_runtime_has_is_a_schema_value():
    # schema values without a factory (megatron) must be refused by validation: test_config_keys walks that
    assert set(BACKENDS) <= _literal(TrainerConfig, "backend")
    assert set(ENGINES) == _literal(GeneratorConfig, "backend")


def _routes(trainers, generators, envs, teacher_groups, per_group):
    k = 0

    def take(n):
        nonlocal k
        k += n
        return list(range(k - n, k))

    return Routes(take(trainers), take(generators), take(envs), {f"t{i}": take(per_group) for i in range(teacher_groups)})


def _per_rank(routes):
    c = Counter()
    for _, src, dst in routes.step_messages():
        c[src] += 1
        c[dst] += 1
    return c


def test_a_generators_messages_do_not_grow_with_the_world():
    small = _per_rank(_routes(2, 4, 2, 2, 2))
    big = _routes(256, 512, 12, 5, 16)  # the flagship's shape: 860 ranks
    c = _per_rank(big)
    # a generator: one order in (the refit after it needs none), rows to its env, each teacher head and the driver
    assert {c[g] for g in big.generators} == {1 + 1 + 5 + 1}
    assert max(small[g] for g in range(2, 6)) == 1 + 1 + 2 + 1
    # an env rank hears from its generators and answers once
    assert max(c[e] for e in big.envs) == -(-512 // 12) + 1
    # a teacher head: every generator, its group and the driver
    assert c[big.teacher_head("t0")] == 512 + 15 + 1


def test_every_generator_has_one_env_and_surplus_env_ranks_are_idle():
    r = _routes(1, 2, 3, 0, 0)
    assert [r.env_of(g) for g in range(2)] == [3, 4]
    assert r.generators_of_env(5) == []

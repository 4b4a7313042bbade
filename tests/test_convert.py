"""The mapping -> dataclass converter collects every problem instead of stopping."""

from __future__ import annotations

from hpc_rl.config.convert import to_typed
from hpc_rl.config.schema import RunConfig


def test_types_literals_and_nesting():
    cfg, errors = to_typed(RunConfig, {
        "trainer": {"nodes": 2, "parallel": {"tp": 2}, "optimizer": {"lr": 1}},
        "teachers": {"math": {"checkpoint": "/m", "nodes": 1}},
        "routing": {"agents": {"math": ["add_*"]}},
    })
    assert errors == []
    assert cfg.trainer.parallel.tp == 2 and cfg.trainer.parallel.cp == 1
    assert isinstance(cfg.trainer.optimizer.lr, float) and cfg.trainer.optimizer.lr == 1.0
    assert cfg.teachers["math"].checkpoint == "/m"
    assert cfg.routing.agents == {"math": ["add_*"]}


def test_all_errors_collected():
    _, errors = to_typed(RunConfig, {
        "trainer": {"nodes": True, "parallel": {"tp": "8"}, "precison": "bf16"},
        "launcher": {"name": "sbatch"},
        "teachers": {"math": {"checkpoint": ["a", "b"]}},
        "routing": {"agents": {"math": "add"}},
        "colour": 1,
    })
    found = {(e.key, e.problem.split(" ")[0]) for e in errors}
    assert ("trainer.nodes", "must") in found  # a bool is not an int
    assert ("trainer.parallel.tp", "must") in found
    assert ("trainer.precison", "unknown") in found
    assert ("launcher.name", "must") in found
    assert ("teachers.math.checkpoint", "must") in found
    assert ("routing.agents.math", "must") in found
    assert ("colour", "unknown") in found
    suggestion = next(e for e in errors if e.key == "trainer.precison")
    assert "precision" in suggestion.fix

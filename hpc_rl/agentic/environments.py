"""The agentic environments a config can name (`env.agentic.environment`): the registry,
above the episode classes it builds (agentic/contract.py is the protocol they implement,
below them), so no module imports one that imports it back."""

from __future__ import annotations

from typing import Callable, Dict, List

from .contract import Episode, SingleTurnEpisode, StepwiseEpisode


_ENVIRONMENTS: Dict[str, Callable[..., Episode]] = {}


def register_environment(name: str, factory: Callable[..., Episode]) -> None:
    """`factory(**cfg) -> Episode`. Re-registering a name with another factory is refused, so
    two environments cannot take one config name silently."""
    if name in _ENVIRONMENTS and _ENVIRONMENTS[name] is not factory:
        raise ValueError(f"environment {name!r} is already registered ({_ENVIRONMENTS[name]!r})")
    _ENVIRONMENTS[name] = factory


def known_environments() -> List[str]:
    return sorted(_ENVIRONMENTS)


def environment_factory(name: str) -> Callable[..., Episode]:
    """A registered name, or `package.module:factory`: a user's environment importable on the
    env ranks (their PYTHONPATH or an installed package), no registration needed. KeyError
    names what is missing."""
    if name in _ENVIRONMENTS:
        return _ENVIRONMENTS[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise KeyError(f"no agentic environment {name!r}; known: {', '.join(known_environments())}, "
                       f"or a 'package.module:factory' the env ranks can import")
    import importlib

    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"agentic environment {name!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
    if not callable(factory):
        raise KeyError(f"agentic environment {name!r}: {attr} is not callable (a factory returning an Episode)")
    return factory


def build_environment(name: str, **cfg) -> Episode:
    """The Episode a config names (`env.agentic.environment`), built with the config's keys."""
    return environment_factory(name)(**cfg)


def _calculator(**cfg) -> Episode:
    from .calculator import CalculatorEnv

    return StepwiseEpisode(lambda: CalculatorEnv(**cfg))


def _python_tool(**cfg) -> Episode:
    from .python_tool import PythonToolEpisode

    return PythonToolEpisode(**cfg)


def _verifiers(**cfg) -> Episode:
    from .verifiers_bridge import VerifiersEpisode

    return VerifiersEpisode(**cfg)


def _gym(**cfg) -> Episode:
    from .gym_bridge import GymEpisode

    return GymEpisode(**cfg)


register_environment("single_turn", lambda **cfg: SingleTurnEpisode(**cfg))
register_environment("verifiers", _verifiers)
register_environment("gym", _gym)
register_environment("calculator", _calculator)
register_environment("python_tool", _python_tool)

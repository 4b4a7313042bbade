"""`generator.backend` -> the InferenceEngine that implements it, imported when chosen."""

from __future__ import annotations

from typing import Callable, Dict

from .base import EngineSpec, InferenceEngine


def _vllm(spec: EngineSpec) -> InferenceEngine:
    from .vllm import VLLMEngine

    return VLLMEngine.from_spec(spec)


# generator.backend -> factory; the schema's Literal and these names agree (tests/test_roles.py)
ENGINES: Dict[str, Callable[[EngineSpec], InferenceEngine]] = {"vllm": _vllm}


def build_follower(name: str, spec: EngineSpec, seat):
    """The workers a follower task hosts for an engine spanning several tasks (engines/spanning.py)."""
    if name != "vllm":
        raise ValueError(f"generator.backend={name!r} has no engines spanning several tasks in this version")
    from .vllm import VLLMEngine

    return VLLMEngine.follower(spec, seat)


def build_engine(name: str, spec: EngineSpec) -> InferenceEngine:
    if name not in ENGINES:
        raise ValueError(f"generator.backend={name!r} has no implementation in this version (have {sorted(ENGINES)})")
    return ENGINES[name](spec)

"""`trainer.backend` -> the TrainingBackend that implements it. Implementations are imported
when chosen (the FSDP2 backend pulls in transformers)."""

from __future__ import annotations

from typing import Callable, Dict, List

from .backend import BackendSpec, TrainingBackend


def _fsdp2(spec: BackendSpec) -> TrainingBackend:
    from .fsdp2 import FSDP2Backend

    return FSDP2Backend.from_spec(spec)


def _megatron(spec: BackendSpec) -> TrainingBackend:
    from .megatron.backend import MegatronBackend  # imports megatron-core: GPU clusters only

    return MegatronBackend.from_spec(spec)


# Names here are values of the schema's Literal (tests/test_roles.py); a schema value with no
# factory would be refused by validation (config/support.py). megatron is refused on CPU
# clusters by validate.py (megatron-core has no CPU path).
BACKENDS: Dict[str, Callable[[BackendSpec], TrainingBackend]] = {"fsdp2": _fsdp2, "megatron": _megatron}


def build_backend(name: str, spec: BackendSpec) -> TrainingBackend:
    if name not in BACKENDS:
        raise ValueError(f"trainer.backend={name!r} has no implementation in this version (have {sorted(BACKENDS)})")
    return BACKENDS[name](spec)


def available() -> List[str]:
    return sorted(BACKENDS)

"""The model family registry: every family the runtime knows, and the questions core code asks
about a checkpoint (issue 46). It sits above the families it registers (each
`families/<name>/` folder builds one `spec.Family`, and imports neither this module nor core
code that asks it), and `spec.py` sits below them all.

Adding a family is one folder and one line in FAMILIES. Core code never tests an architecture
name: it calls `of_config(config.json)` (or `named(model.architecture)`) and reads the
family's fields. Nothing here imports torch: the launcher and config validation use it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional, Tuple

from .gemma3 import FAMILY as GEMMA3
from .generic import GENERIC
from .granite import FAMILY as GRANITE
from .llama import FAMILY as LLAMA
from .mistral import FAMILY as MISTRAL
from .nemotron_h import FAMILY as NEMOTRON_H
from .phi3 import FAMILY as PHI3
from .qwen2 import FAMILY as QWEN2
from .qwen3 import FAMILY as QWEN3
from .qwen3_moe import FAMILY as QWEN3_MOE
from .spec import Family

FAMILIES: Tuple[Family, ...] = (
    LLAMA,
    QWEN2,
    QWEN3,
    QWEN3_MOE,
    NEMOTRON_H,
    MISTRAL,
    GRANITE,
    PHI3,
    GEMMA3,
)

# model.architecture's default (config/schema.py): the tiny test models' family
DEFAULT = LLAMA.name


def named(model_type: Optional[str]) -> Optional[Family]:
    """The family of a model_type (model.architecture, config.json's model_type; `generic`: the
    generic path), or None."""
    return next((f for f in FAMILIES + (GENERIC,) if model_type in f.all_model_types), None)


def of_architecture(arch: str) -> Optional[Family]:
    """The family of a config.json `architectures` class, or None."""
    return next((f for f in FAMILIES if arch in f.architectures), None)


def of_config(config: Mapping) -> Optional[Family]:
    """The family of a Hugging Face config (config.json's mapping): by its architectures where
    it lists them (a checkpoint's class decides what transformers builds), else by its
    model_type; None for a model no family describes."""
    archs = config.get("architectures") or []
    if archs:
        return next((f for f in map(of_architecture, archs) if f is not None), None)
    return named(config.get("model_type"))


def resolve(config: Mapping) -> Optional[Family]:
    """The family of a config, else the generic path (GENERIC) for any other `*ForCausalLM`
    (transformers loads it by its config; the ranks find out whether it can), else None."""
    fam = of_config(config)
    if fam is None and any(str(a).endswith("ForCausalLM") for a in config.get("architectures") or []):
        return GENERIC
    return fam


def fsdp2_names() -> Tuple[str, ...]:
    """model.architecture values the fsdp2 backend loads (the generic path last)."""
    return tuple(f.name for f in FAMILIES if f.fsdp2) + (GENERIC.name,)


def moe_names() -> Tuple[str, ...]:
    """... of which expert parallel splits the experts (the MoE families)."""
    return tuple(f.name for f in FAMILIES if f.fsdp2 and f.experts is not None)


def megatron_names() -> Tuple[str, ...]:
    """model.architecture values the megatron backend converts."""
    return tuple(f.name for f in FAMILIES if f.megatron is not None)


def fsdp2_architectures() -> Tuple[str, ...]:
    """The config.json classes of the fsdp2 families (the launcher's checkpoint check)."""
    return tuple(a for f in FAMILIES if f.fsdp2 for a in f.architectures)


def expert_blocks() -> Tuple[Tuple[Family, str], ...]:
    """(family, HF MoE block class) of every MoE family."""
    return tuple((f, b) for f in FAMILIES if f.experts is not None for b in f.experts.blocks)


def hf_config(checkpoint: str) -> Optional[dict]:
    """A checkpoint directory's config.json (None where it has none: a layout then reads the
    tensors' shapes alone)."""
    path = Path(checkpoint) / "config.json"
    return json.loads(path.read_text()) if path.exists() else None

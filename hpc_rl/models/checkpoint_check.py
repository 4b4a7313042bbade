"""The launcher's check of a Hugging Face checkpoint directory before any rank starts: its
config, architecture, tokenizer and weights files. Reads files only (no torch import: the
launcher process of every run does this)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

from hpc_rl.models import families
from hpc_rl.models.families.spec import TensorParallelPlan, divisibility

# HF class -> model.architecture, for the families the fsdp2 backend loads (config/support.py
# ARCHITECTURES lists the same values: both come from the family registry)
ARCHITECTURE_NAMES = {a: f.name for f in families.FAMILIES if f.fsdp2 for a in f.architectures}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_NAMES)


class CheckpointError(ValueError):
    pass


def check_checkpoint(path: str) -> dict:
    """Refuse, before any rank starts, a directory that is not a checkpoint of a family the fsdp2
    backend loads, with its tokenizer; returns its config."""
    p = Path(path)
    if not (p / "config.json").exists():
        raise CheckpointError(f"{path}: no config.json; model.path must be a Hugging Face checkpoint directory")
    cfg = json.loads((p / "config.json").read_text())
    archs = cfg.get("architectures") or []
    fam = families.resolve(cfg)  # a family of the registry, else the generic path for another *ForCausalLM
    if fam is None or not fam.fsdp2:
        raise CheckpointError(f"{path}: architecture {archs or cfg.get('model_type')} is not supported; "
                              f"supported: {list(SUPPORTED_ARCHITECTURES)}, and any other *ForCausalLM that "
                              f"transformers loads and vLLM serves on the generic path")
    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise CheckpointError(f"{path}: no tokenizer (tokenizer.json or tokenizer.model); save the tokenizer beside the weights")
    if not any(p.glob("*.safetensors")):
        raise CheckpointError(f"{path}: no *.safetensors weights")
    return cfg


def tp_problems(config, tp: int) -> List[str]:
    """Why `tp` cannot split this HF config with its family's tensor-parallel plan (the Llama
    plan's keys where the family is unknown; empty: it can). Used by validation and here."""
    if tp <= 1:
        return []
    fam = families.resolve(config)
    plan = fam.tp_plan if fam is not None and fam.tp_plan is not None else TensorParallelPlan()
    out = divisibility(config, plan.divides, tp)
    if config.get("tie_word_embeddings"):
        out.append("tie_word_embeddings=true: the embedding (row split) and lm_head (column split) cannot share one weight")
    return out

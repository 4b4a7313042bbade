"""The launcher's check of a Hugging Face checkpoint directory before any rank starts: its
config, architecture, tokenizer and weights files. Reads files only (no torch import: the
launcher process of every run does this)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

# HF class -> model.architecture (config/support.py ARCHITECTURES lists the same values)
# NemotronHForCausalLM: transformers' dense hybrid (its PyTorch Mamba-2 path on CPU), data parallel only
# (rl/inputs.py refuses its tp/cp: parallel/ knows Llama-style layers only)
ARCHITECTURE_NAMES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3MoeForCausalLM": "qwen3_moe",
                      "NemotronHForCausalLM": "nemotron_h"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_NAMES)


class CheckpointError(ValueError):
    pass


def check_checkpoint(path: str) -> dict:
    """Refuse, before any rank starts, a directory that is not a loadable Llama/Qwen2/Qwen3-MoE/Nemotron-H
    checkpoint with its tokenizer; returns its config."""
    p = Path(path)
    if not (p / "config.json").exists():
        raise CheckpointError(f"{path}: no config.json; model.path must be a Hugging Face checkpoint directory")
    cfg = json.loads((p / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise CheckpointError(f"{path}: architecture {archs or cfg.get('model_type')} is not supported; "
                              f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise CheckpointError(f"{path}: no tokenizer (tokenizer.json or tokenizer.model); save the tokenizer beside the weights")
    if not any(p.glob("*.safetensors")):
        raise CheckpointError(f"{path}: no *.safetensors weights")
    return cfg


def tp_problems(config, tp: int) -> List[str]:
    """Why `tp` cannot split this HF config (empty: it can). Used by validation and here."""
    if tp <= 1:
        return []
    need = {"num_attention_heads": config.get("num_attention_heads"),
            "num_key_value_heads": config.get("num_key_value_heads") or config.get("num_attention_heads"),
            "intermediate_size": config.get("intermediate_size"), "vocab_size": config.get("vocab_size")}
    out = [f"{k}={v} is not divisible by tp={tp}" for k, v in need.items() if v is None or v % tp]
    if config.get("tie_word_embeddings"):
        out.append("tie_word_embeddings=true: the embedding (row split) and lm_head (column split) cannot share one weight")
    return out

"""What the Megatron backend needs besides megatron-core: the Hugging Face checkpoint read
whole, the learning-rate schedule (fsdp2's rule: linear warmup, then constant), whether
Transformer Engine is installed, and a meta-device HF model that carries the config and
tied names for the HF export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Tuple

import torch


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def lr_at(step: int, train: Any) -> float:
    o, s = train.optimizer, train.scheduler
    if s.warmup_steps <= 0 or step >= s.warmup_steps:
        return o.lr
    return s.warmup_start_lr + (o.lr - s.warmup_start_lr) * step / s.warmup_steps


def read_hf(path: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    p = Path(path)
    cfg = json.loads((p / "config.json").read_text())
    state: Dict[str, torch.Tensor] = {}
    for f in sorted(p.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return cfg, state


def meta_hf_model(path: str):
    """An HF model on the meta device: its config and tied names for the HF export."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    try:
        m.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    return m


def check_hybrid_packages(te: bool) -> None:
    """Nemotron-H on megatron-core 0.16.1: its MambaModel stack spec is built of Transformer
    Engine modules, and its Mamba mixer runs mamba-ssm's and causal-conv1d's kernels."""
    missing = [] if te else ["transformer-engine"]
    for module, package in (("mamba_ssm", "mamba-ssm"), ("causal_conv1d", "causal-conv1d")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise ValueError(f"Nemotron-H on the megatron backend needs {', '.join(missing)} on this node (megatron-core's "
                         "MambaModel: Transformer Engine layers, mamba-ssm/causal-conv1d kernels): install the gpu "
                         "extra (pip install --no-build-isolation -e '.[gpu]') or use the container image")

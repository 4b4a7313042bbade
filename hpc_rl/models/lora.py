"""LoRA adapters on the fsdp2 student (`trainer.lora.*`), with the `peft` library.

peft injects its LoRA wrappers into the HF model in place (`inject_adapter_in_model`, no
PeftModel around it), so `model.model.layers` (activation checkpointing, FSDP2's per-layer
sharding) and `generate` stay as they are. Only the adapters' A/B matrices require gradients,
so the optimizer (built over the parameters that do) holds their state alone.

Names: an adapted linear `...q_proj` becomes `...q_proj.base_layer.weight` (the frozen W) plus
`...q_proj.lora_A.default.weight` [r, in] and `...q_proj.lora_B.default.weight` [out, r].
Everything that leaves the trainer as weights (refit, the merged export, the weights digest)
speaks the HF names, with W + B @ A * alpha / r in place of W (`merged_state`, `merged_shards`).
"""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .families import of_config

ADAPTER = "default"  # peft's adapter name; one adapter per student
_BASE = ".base_layer."
_A, _B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"
# lora_A is drawn from this seed on every rank alike (kaiming uniform, peft's own init): FSDP2 shards
# each rank's local copy, so ranks that drew from their own RNG states would build a mixed matrix
INIT_SEED = 0x10A


def resolve_targets(model: torch.nn.Module, target_modules: Optional[List[str]]) -> List[str]:
    """trainer.lora.target_modules, or the model family's default; each must name a linear module."""
    model_type = getattr(model.config, "model_type", "?")
    family = of_config(model.config.to_dict())
    targets = list(target_modules or (family.lora_targets if family else ()))
    if not targets:
        raise ValueError(f"trainer.lora.target_modules: model_type {model_type!r} has no default LoRA targets "
                         "(its family folder under hpc_rl/models/families/ names none); set "
                         "trainer.lora.target_modules to its linear modules")
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in targets if t not in linear]
    if missing:
        raise ValueError(f"trainer.lora.target_modules: {missing} name no nn.Linear of this {model_type} model "
                         f"(its linear modules: {sorted(linear)})")
    return targets


def apply_lora(model: torch.nn.Module, lora) -> List[str]:
    """Inject adapters per `lora` (the trainer.lora section) and freeze everything else; returns the
    target modules. The model's outputs are unchanged (B starts at zero)."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = resolve_targets(model, lora.target_modules)
    config = LoraConfig(r=int(lora.rank), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                        target_modules=targets, bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    gen = torch.Generator().manual_seed(INIT_SEED)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
        if name.endswith(_A):
            with torch.no_grad():
                torch.nn.init.kaiming_uniform_(p, a=math.sqrt(5), generator=gen)
    model.hpc_rl_lora = {"config": config, "scale": float(lora.alpha) / int(lora.rank)}
    return targets


@contextmanager
def eval_mode(model: torch.nn.Module):
    """The model in eval mode (no dropout) for the scope, its mode put back after."""
    was = model.training
    model.train(False)
    try:
        yield
    finally:
        model.train(was)


@contextmanager
def adapters_off(model: torch.nn.Module):
    """The base model for the scope (every LoRA layer's forward is its base layer alone), the adapters
    back on after: the reference model of algo.ref_kl_coef with LoRA, no second copy of the weights.
    peft's BaseTunerLayer.enable_adapters on each injected layer (PeftModel.disable_adapter does the
    same; there is no PeftModel here). Under FSDP2 every rank runs the same forwards, so every rank
    switches alike. enable_adapters(False) also clears the adapters' requires_grad; enable_adapters(True)
    sets it back for the active adapter (the only one), so training goes on as before."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """A peft name of a frozen base weight -> its HF checkpoint name."""
    return name.replace(_BASE, ".")


def adapter_scale(model: torch.nn.Module) -> float:
    return model.hpc_rl_lora["scale"]


def _full(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 holds every parameter as a DTensor: gathering an adapter is a collective of the group
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _pairs(state: Dict[str, torch.Tensor]) -> Iterable[Tuple[str, str, str]]:
    """(base weight name, A name, B name) per adapted module, in state-dict order."""
    for name in state:
        if name.endswith(_BASE + "weight"):
            stem = name[: -len(_BASE + "weight")]
            yield name, stem + _A, stem + _B


def delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """LoRA's update of W: B @ A * scale (what peft's merge adds)."""
    return (b @ a) * scale


def merged_state(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A whole (unsharded) peft state dict -> HF names, each adapted W replaced by W + B @ A * scale."""
    scale = adapter_scale(model)
    out: Dict[str, torch.Tensor] = {}
    merged = {w: delta(state[a], state[b], scale) for w, a, b in _pairs(state)}
    for name, t in state.items():
        if is_adapter(name):
            continue
        out[hf_name(name)] = t + merged[name].to(t.dtype) if name in merged else t
    return out


def merged_boxes(model: torch.nn.Module, boxes: Dict[str, Tuple[Tuple[int, ...], torch.Tensor]],
                 state: Dict[str, torch.Tensor]) -> Dict[str, Tuple[Tuple[int, ...], torch.Tensor]]:
    """This rank's boxes (global start, local tensor) of a peft state dict -> HF names, adapted boxes
    merged: W's rows [s, s + n) get (B @ A)[s : s + n] * scale. Every rank gathers every adapter
    (a collective, in the same order on all ranks); adapters are small beside the weights."""
    scale = adapter_scale(model)
    out = {}
    pairs = {w: (a, b) for w, a, b in _pairs(state)}
    for name, (start, local) in boxes.items():
        if is_adapter(name):
            continue
        if name in pairs:
            a, b = (_full(state[n]) for n in pairs[name])
            rows = slice(start[0], start[0] + local.shape[0])
            cols = slice(start[1], start[1] + local.shape[1])
            local = local + delta(a, b[rows], scale)[:, cols].to(local.dtype)
        out[hf_name(name)] = (start, local)
    return out


def full_adapters(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every adapter tensor whole, by peft name, on CPU (a collective of the group under FSDP2)."""
    return {n: _full(t).cpu() for n, t in model.state_dict().items() if is_adapter(n)}


def adapter_state(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The adapters alone from a whole state dict, in the names a PEFT adapter directory stores
    (`base_model.model.<name>` without the adapter name), as `save_pretrained` writes them."""
    return {"base_model.model." + n.replace(f".{ADAPTER}.", "."): t for n, t in state.items() if is_adapter(n)}


def write_adapter_dir(model: torch.nn.Module, state: Dict[str, torch.Tensor], out_dir, base_path: str) -> Path:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) that
    `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out_dir)` loads and
    vLLM serves as a LoRA adapter."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.hpc_rl_lora["config"]
    cfg.base_model_name_or_path = str(base_path)
    cfg.save_pretrained(str(out))
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in adapter_state(model, state).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


# bytes read per weight file for the base digest: 16 evenly spaced 256 KiB windows, so a 70B base
# costs 16 reads per file, not 140 GB; two bases of one architecture differ in every window
_WINDOWS, _WINDOW_BYTES = 16, 256 << 10


@lru_cache(maxsize=8)
def base_reference(path: str) -> Dict[str, str]:
    """What a LoRA checkpoint records of its base model: the path and a digest of its config.json
    and of its weight files (names, sizes and sampled windows of their bytes); a resume onto
    another base is refused (checkpoints are saved often: the digest is computed once per path)."""
    p = Path(path)
    h = hashlib.sha256((p / "config.json").read_bytes())
    for f in sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for i in range(_WINDOWS):
                fh.seek(size * i // _WINDOWS)
                h.update(fh.read(_WINDOW_BYTES))
    return {"base_checkpoint": str(path), "base_digest": h.hexdigest()}


def lora_meta(model: torch.nn.Module, base_path: str) -> Dict[str, object]:
    """A checkpoint manifest's `lora` entry: the adapter's shape and its base."""
    cfg = model.hpc_rl_lora["config"]
    return {"rank": cfg.r, "alpha": cfg.lora_alpha, "target_modules": sorted(cfg.target_modules),
            **base_reference(base_path)}


def checkpoint_meta(backend) -> Optional[Dict[str, object]]:
    """A checkpoint manifest's `lora` entry for this backend: None when it trains every weight."""
    if getattr(backend, "lora", None) is None:
        return None
    return lora_meta(backend.model, backend.checkpoint_dir)


def meta_mismatch(saved: Optional[Dict[str, object]], live: Optional[Dict[str, object]]) -> Optional[str]:
    """Why a checkpoint's LoRA entry does not fit this run's, or None when it does."""
    if saved is None and live is None:
        return None
    if saved is None or live is None:
        return ("the checkpoint holds " + ("full weights" if saved is None else "LoRA adapters") + " and this run "
                + ("trains LoRA adapters" if saved is None else "fine-tunes every weight") + " (trainer.lora.enabled)")
    diff = [f"{k}: saved {saved.get(k)!r}, now {live.get(k)!r}" for k in sorted(live) if saved.get(k) != live.get(k)
            and k != "base_checkpoint"]
    return "; ".join(diff) if diff else None


def summary(model: torch.nn.Module) -> str:
    train = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
    total = sum(p.numel() for p in model.parameters())
    return f"LoRA r={model.hpc_rl_lora['config'].r}: {train:,} of {total:,} parameters train ({100 * train / total:.2f}%)"

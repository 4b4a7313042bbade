"""Validation of LoRA (`trainer.lora.*`; the fsdp2 backend's models/lora.py), beside validate.py:
what the adapters cannot honour in this version is refused here, before anything is submitted."""

from __future__ import annotations

import dataclasses
from typing import List

from .errors import Violation, check_positive
from .schema import ReferenceConfig
from .schema_lora import MAX_LORA_RANKS, LoraConfig


def check_lora(out: List[Violation], cfg) -> None:
    t, lo = cfg.trainer, cfg.trainer.lora
    if not lo.enabled:
        for f in dataclasses.fields(LoraConfig):
            key, value, default = f.name, getattr(lo, f.name), getattr(LoraConfig(), f.name)
            if key != "enabled" and value != default:
                out.append(Violation(f"trainer.lora.{key}", value, "it applies to LoRA adapters, and "
                                     "trainer.lora.enabled is false: it would be ignored",
                                     f"set trainer.lora.enabled=true, or remove trainer.lora.{key}"))
        return
    check_positive(out, "trainer.lora.rank", lo.rank)
    if not lo.alpha > 0:
        out.append(Violation("trainer.lora.alpha", lo.alpha, "the update is B @ A * alpha / rank: alpha must be > 0",
                             "e.g. trainer.lora.alpha=32 (twice the rank is common)"))
    if not 0.0 <= lo.dropout < 1.0:
        out.append(Violation("trainer.lora.dropout", lo.dropout, "a dropout probability is in [0, 1)",
                             "e.g. trainer.lora.dropout=0.0"))
    if lo.target_modules is not None and (not lo.target_modules or not all(isinstance(m, str) and m
                                                                             for m in lo.target_modules)):
        out.append(Violation("trainer.lora.target_modules", lo.target_modules, "must name at least one linear module",
                             "e.g. trainer.lora.target_modules=[q_proj,v_proj], or null for the family's default"))
    if t.backend == "megatron":
        # checked on the served wheel: megatron-core 0.16.1 has no PEFT/LoRA modules (its only "lora"
        # names are multi-latent attention's q/kv_lora_rank), and Megatron-Bridge (its PEFT) is not installed
        out.append(Violation("trainer.lora.enabled", True, "trainer.backend=megatron has no LoRA: megatron-core 0.16.1 "
                             "ships no PEFT and Megatron-Bridge is not part of this install",
                             "use trainer.backend=fsdp2 with trainer.lora, or set trainer.lora.enabled=false"))
    p = t.parallel
    for name, why in (("tp", "tensor parallel's plans (models/parallel/tensor_parallel.py) shard nn.Linear "
                       "modules by name, and peft replaces each target with a LoRA wrapper holding its own "
                       "A/B pair, which the plan does not split"),
                      ("cp", "context parallel with adapters is not tested in this version"),
                      ("ep", "the experts are fused 3-D parameters peft cannot adapt, and the expert-parallel "
                       "parameter groups are not built around frozen weights"),
                      ("pp", "the fsdp2 backend has no pipeline parallel")):
        if getattr(p, name) > 1:
            out.append(Violation(f"trainer.parallel.{name}", getattr(p, name), f"with trainer.lora: {why}",
                                 f"set trainer.parallel.{name}=1 (LoRA runs data parallel), or trainer.lora.enabled=false"))
    if t.cpu_offload:
        out.append(Violation("trainer.cpu_offload", True, "with trainer.lora: offloading frozen base shards is not "
                             "tested in this version (LoRA's optimizer state is small already)",
                             "set trainer.cpu_offload=false, or trainer.lora.enabled=false"))
    if cfg.algo.ref_kl_coef > 0:
        check_reference_section(out, cfg)
    if lo.refit == "adapter" and lo.rank > MAX_LORA_RANKS[-1]:
        out.append(Violation("trainer.lora.rank", lo.rank, f"with trainer.lora.refit=adapter the engines serve the adapter "
                             f"as a vLLM LoRA, whose max_lora_rank is at most {MAX_LORA_RANKS[-1]} (vLLM 0.32)",
                             f"trainer.lora.rank<={MAX_LORA_RANKS[-1]}, or trainer.lora.refit=merged"))
    # trainer.lora.refit=adapter with in-flight weight updates and with multi-turn episodes: both honoured.
    # Every request carries the student's adapter from the first on (refit 0, loaded at join), an in-flight
    # load replaces it in place while the scheduler is paused, and the serving loop passes it too
    # (refit/adapter_refit.py; tests/test_in_flight_adapter_refit.py checks the log-probs against peft).


def check_reference_section(out: List[Violation], cfg) -> None:
    """With trainer.lora the reference model is the student's base with the adapters off, scored by the
    trainer ranks in trainer.precision (config/resources.py reference_on_trainer): a `reference:` key that
    asks for anything else (another checkpoint, its own ranks or precision) cannot be honoured."""
    ref, default = cfg.reference, ReferenceConfig()
    for f in dataclasses.fields(ReferenceConfig):
        value = getattr(ref, f.name)
        if value == getattr(default, f.name):
            continue
        if f.name == "checkpoint" and value == cfg.model.path:  # the student's base: what it is anyway
            continue
        if f.name == "precision" and value == cfg.trainer.precision:
            continue
        out.append(Violation(f"reference.{f.name}", value, "with trainer.lora the reference model is the student's "
                             "base (model.path) with the adapters off, scored by the trainer ranks in "
                             "trainer.precision: no reference rank group is placed, so this key would be ignored",
                             f"remove reference.{f.name}, or set trainer.lora.enabled=false for a reference "
                             "model of its own"))

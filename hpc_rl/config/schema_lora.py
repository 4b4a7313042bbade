"""The student's LoRA keys (`trainer.lora.*`), beside schema.py.

Its comments document the keys like schema.py's do (hpc_rl/config/reference.py reads every
schema*.py). What the runtime cannot honour is refused by config/validate_lora.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Literal, Optional

from .trace import Traced

# vLLM 0.32's allowed max_lora_rank values (vllm/config/lora.py MaxLoRARanks): the engines of
# trainer.lora.refit=adapter take the smallest that holds trainer.lora.rank (refit/adapter_refit.py;
# vLLM pads a lower-rank adapter up); a rank above the last is refused (config/validate_lora.py)
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoraConfig(Traced):
    """LoRA adapters on the student (peft): the base weights stay frozen, only the adapters get
    gradients and optimizer state (hpc_rl/models/lora.py). fsdp2 only, data parallel only."""

    enabled: bool = False  # train LoRA adapters instead of every weight of the student
    rank: int = 16  # the adapters' rank r (each adapted linear W [out, in] gets B [out, r] and A [r, in])
    alpha: float = 32.0  # LoRA's alpha: the update is B @ A * alpha / rank
    # Dropout on each adapter's input in the train step (peft's lora_dropout); the no-grad log-prob pass,
    # greedy evaluation and the engines run without it. In [0, 1).
    dropout: float = 0.0
    # The linear modules (name suffixes, peft's target_modules) that get adapters. None: the model
    # family's default (its `lora_targets` in hpc_rl/models/families/<family>/, by the checkpoint's config.json).
    target_modules: Optional[List[str]] = None
    # How the generators' engines get the trained weights after each step. merged: W + B @ A * alpha / rank
    # for every adapted weight, through the full refit (refit/), the engines unchanged. adapter: engines
    # built with vLLM's LoRA support (enable_lora, max_lora_rank) and only the adapters sent and replaced
    # in place at each refit, in-flight weight updates and multi-turn episodes included (every request
    # carries the adapter from the first on: refit/adapter_refit.py).
    refit: Literal["merged", "adapter"] = "merged"
    # The final export (checkpoint.export_final) writes a PEFT adapter directory (final_adapter/); with
    # this also the merged Hugging Face checkpoint (final_hf/, what the run's export is without LoRA).
    export_merged: bool = False

"""The student's optimizer and learning-rate schedule (`trainer.optimizer`, `trainer.scheduler`),
beside schema.py.

Its comments document the keys like schema.py's do (hpc_rl/config/reference.py reads both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal

from .trace import Traced


@dataclass
class OptimizerConfig(Traced):
    name: Literal["adamw", "adam"] = "adamw"  # adamw: decoupled weight decay; adam: decay added to the gradient
    lr: float = 1e-6  # learning rate after warmup (constant from then on)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam's (beta1, beta2)
    eps: float = 1e-8  # Adam's epsilon
    weight_decay: float = 0.0  # weight decay coefficient
    grad_clip: float = 1.0  # gradients are clipped to this total L2 norm before each optimizer step


@dataclass
class SchedulerConfig(Traced):
    name: Literal["constant_with_warmup"] = "constant_with_warmup"  # the only schedule: linear warmup, then constant
    warmup_steps: int = 0  # optimizer steps of the warmup; 0: optimizer.lr from the first step
    warmup_start_lr: float = 0.0  # linear ramp from this to optimizer.lr over warmup_steps

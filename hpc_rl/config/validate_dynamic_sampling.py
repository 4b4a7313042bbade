"""Validation of DAPO's dynamic sampling (`algo.dynamic_sampling`, hpc_rl/rl/dynamic_sampling.py),
beside validate.py."""

from __future__ import annotations

from typing import List

from .errors import Violation, check_positive

KEY = "algo.dynamic_sampling"


def check_dynamic_sampling(out: List[Violation], cfg) -> None:
    a = cfg.algo
    ds = a.dynamic_sampling
    check_positive(out, f"{KEY}.max_collections", ds.max_collections)
    if not ds.enabled:
        return
    if a.name != "grpo":  # MOPD's per-token advantages come from teachers, not from a group's rewards
        out.append(Violation(f"{KEY}.enabled", True, f"dynamic sampling drops GRPO groups of one reward; "
                             f"algo.name={a.name} has no reward groups",
                             f"set algo.name=grpo or {KEY}.enabled=false"))
    elif a.generations_per_prompt < 2:
        out.append(Violation(f"{KEY}.enabled", True, f"a group of algo.generations_per_prompt="
                             f"{a.generations_per_prompt} sample always has one reward: every group would be dropped",
                             f"set algo.generations_per_prompt >= 2 or {KEY}.enabled=false"))
    # Multi-turn episodes add sibling samples (rl/siblings.py) after a collection's items and
    # merge per-collection episode figures (agentic/figures.py): selecting and joining groups of
    # several collections does not carry them yet. Refused rather than trained wrongly.
    if cfg.env.agentic.environment:
        out.append(Violation(f"{KEY}.enabled", True, f"dynamic sampling is not supported with multi-turn episodes "
                             f"(env.agentic.environment={cfg.env.agentic.environment}): their sibling samples and "
                             "episode figures are not carried across a step's several collections",
                             f"set {KEY}.enabled=false, or leave env.agentic.environment unset"))

"""Checks of the algorithm options users bring from NeMo RL (config/schema_algo.py): the
reference KL, GSPO, the loss aggregation, DAPO's overlong options, GRPO's advantage clip.
Each refusal names the key, why the runtime cannot honour it, and what to set."""

from __future__ import annotations

from typing import List

from .errors import Violation
from .resources import REFERENCE
from .schema import RunConfig
from .validate_dynamic_sampling import check_dynamic_sampling


def check_reference(out: List[Violation], cfg: RunConfig) -> None:
    a = cfg.algo
    if REFERENCE in cfg.teachers:
        out.append(Violation("teachers", sorted(cfg.teachers), "a teacher's alias is 'reference', the reference "
                             "model's name among the teacher groups", "give that teacher another alias"))
    if a.ref_kl_coef <= 0:
        if cfg.reference.checkpoint:
            out.append(Violation("reference.checkpoint", cfg.reference.checkpoint,
                                 "algo.ref_kl_coef is 0: no reference role is placed and this checkpoint would be ignored",
                                 "set algo.ref_kl_coef > 0 (e.g. 0.01) or remove reference.checkpoint"))
        return
    k = a.ref_kl
    for key, v in (("input_clamp", k.input_clamp), ("output_clamp", k.output_clamp)):
        if v is not None and v <= 0:
            out.append(Violation(f"algo.ref_kl.{key}", v, "a clamp bound must be > 0 (the clamp is [-v, v])",
                                 f"set algo.ref_kl.{key} > 0, or null for no clamp"))
    if k.apply_to == "reward" and a.name != "grpo":
        out.append(Violation("algo.ref_kl.apply_to", "reward",
                             f"algo.name={a.name}: its advantages come from the teachers' log-probs, not from rewards, "
                             "so a penalty in the reward would change nothing",
                             "set algo.ref_kl.apply_to=loss"))


def check_loss(out: List[Violation], cfg: RunConfig) -> None:
    a = cfg.algo
    lo = a.loss
    if lo.ratio_level == "sequence":
        if lo.kind != "ppo":
            out.append(Violation("algo.loss.ratio_level", "sequence", "GSPO's sequence-level ratio is an importance "
                                 "ratio; algo.loss.kind=reinforce has none", "set algo.loss.kind=ppo"))
        if lo.aggregation == "token-mean":
            # NeMo RL asserts the same: a sequence's one ratio weighs its tokens alike only per sequence
            out.append(Violation("algo.loss.aggregation", "token-mean", "GSPO's sequence-level ratio goes with a "
                                 "sequence-level loss (NeMo RL refuses token_level_loss with it)",
                                 "set algo.loss.aggregation=seq-mean-token-mean"))
        if a.mismatch.kind != "none":
            out.append(Violation("algo.mismatch.kind", a.mismatch.kind, "GSPO's ratio is per sequence, while this "
                                 "version's train/inference weights are per token: mixing the levels biases the ratio",
                                 "set algo.mismatch.kind=none with algo.loss.ratio_level=sequence"))
    g = a.grpo
    for key in ("adv_clip_low", "adv_clip_high"):
        if getattr(g, key) is not None and a.name != "grpo":
            out.append(Violation(f"algo.grpo.{key}", getattr(g, key), f"clips GRPO's advantages; algo.name={a.name}",
                                 "remove it (MOPD's advantages are clipped by algo.opd.adv_clip)"))
    if g.adv_clip_low is not None and g.adv_clip_high is not None and g.adv_clip_low >= g.adv_clip_high:
        out.append(Violation("algo.grpo.adv_clip_low", g.adv_clip_low, f"must be below adv_clip_high={g.adv_clip_high}",
                             "e.g. algo.grpo.adv_clip_low=-5 algo.grpo.adv_clip_high=5"))


def check_overlong(out: List[Violation], cfg: RunConfig) -> None:
    a, o = cfg.algo, cfg.algo.overlong_shaping
    if not o.enabled:
        return
    max_tokens = cfg.generator.sampling.max_tokens
    if a.name != "grpo":
        out.append(Violation("algo.overlong_shaping.enabled", True, f"shapes the rewards; algo.name={a.name}'s "
                             "advantages do not use them", "set algo.overlong_shaping.enabled=false"))
    if not 1 <= o.buffer_tokens <= max_tokens:
        out.append(Violation("algo.overlong_shaping.buffer_tokens", o.buffer_tokens,
                             f"the penalty ramps over the last buffer_tokens before generator.sampling.max_tokens="
                             f"{max_tokens}: it must be in [1, {max_tokens}]",
                             f"e.g. algo.overlong_shaping.buffer_tokens={max(1, max_tokens // 4)}"))
    if o.penalty < 0:
        out.append(Violation("algo.overlong_shaping.penalty", o.penalty, "a negative penalty rewards length",
                             "set algo.overlong_shaping.penalty >= 0 (DAPO: 1.0)"))
    if cfg.env.agentic.environment:
        out.append(Violation("algo.overlong_shaping.enabled", True, "a multi-turn episode's response holds several "
                             "turns and tool outputs, while generator.sampling.max_tokens bounds one turn: its length "
                             "has no max_tokens to be measured against",
                             "set algo.overlong_shaping.enabled=false (algo.loss.overlong_filtering works with episodes)"))


def check_algo_options(out: List[Violation], cfg: RunConfig) -> None:
    check_dynamic_sampling(out, cfg)
    check_reference(out, cfg)
    check_loss(out, cfg)
    check_overlong(out, cfg)

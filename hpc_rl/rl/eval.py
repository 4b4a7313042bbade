"""Validation on fixed held-out prompts (rl/heldout.py) at the start, every
data.validation.every_steps and at the end of a run: greedy accuracy per task and its mean
over tasks (`accuracy_mean`, checkpoint.best_metric's default as `val/accuracy_mean`); with
data.validation.k > 1, pass@k and mean@k of k samples per prompt at
data.validation.temperature; with teachers, the reverse KL of sampled answers to their
routed teacher (and, at the start, each teacher's own accuracy: what the student is
distilled toward). The record is kind "eval"; observe/metrics.py names its metrics `val/...`."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from hpc_rl.algo import reverse_kl_per_teacher
from hpc_rl.data.dataset import PromptRecord
from hpc_rl.engines.base import Sampling

from hpc_rl.messaging.messages import Batch
from .collect import Collector

GREEDY_STREAM, SAMPLED_STREAM, PASS_K_STREAM = 2, 3, 4  # seed streams of the eval collections (training uses 1)


def reverse_kl(b: Batch) -> Dict[str, float]:
    names = sorted(set(b.aliases))
    index = torch.tensor([names.index(a) for a in b.aliases])
    # rows the train step left out (trainer.skip_zero_advantage) have no trainer log-probs (NaN)
    have = ~torch.isnan(b.student_logprobs).any(dim=1, keepdim=True)
    return reverse_kl_per_teacher(b.student_logprobs.nan_to_num(0.0), b.teacher_logprobs,
                                  b.rollouts.response_mask & have, index, names)


def accuracy_by_task(records: Sequence[PromptRecord], correct: Optional[Sequence[Optional[bool]]]) -> Dict[str, float]:
    by: Dict[str, List[bool]] = {}
    for r, c in zip(records, correct or []):
        if c is not None:
            by.setdefault(r.agent, []).append(c)
    return {k: sum(v) / len(v) for k, v in sorted(by.items())}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with c correct of n samples: 1 - C(n-c, k) / C(n, k),
    the chance that k of the n samples drawn without replacement hold a correct one (with
    n = k, as validation samples it, whether any sample is correct)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_and_mean_at_k(records: Sequence[PromptRecord], correct: Optional[Sequence[Optional[bool]]],
                       k: int) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Per task: the mean over prompts of pass@k, and mean@k (the share of correct samples),
    from k consecutive samples per prompt; a prompt with an unscored sample is left out."""
    passed: Dict[str, List[float]] = {}
    share: Dict[str, List[float]] = {}
    correct = list(correct or [])
    for i in range(0, len(records) - k + 1, k):
        got = correct[i:i + k]
        if len(got) < k or any(c is None for c in got):
            continue
        c, agent = sum(bool(x) for x in got), records[i].agent
        passed.setdefault(agent, []).append(pass_at_k(k, c, k))
        share.setdefault(agent, []).append(c / k)
    return ({a: sum(v) / len(v) for a, v in sorted(passed.items())},
            {a: sum(v) / len(v) for a, v in sorted(share.items())})


def mean_of(d: Dict[str, float]) -> Optional[float]:
    """The unweighted mean over tasks (every task counts the same, whatever its prompts)."""
    return sum(d.values()) / len(d) if d else None


def fmt(d: Dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in d.items()) or "-"


def evaluate(collector: Collector, tag: str, evals: List[PromptRecord], step: int, sampling: Sampling,
             distill: bool, k: int = 1, temperature: float = 1.0) -> Optional[dict]:
    """Every trainer rank calls it; the driver returns the eval record, the others None."""
    driver = collector.is_driver
    mine = evals if driver else None
    g = collector.collect(mine, sampling.greedy(), GREEDY_STREAM, step, score_env=True, score_teachers=False)
    at_k: Tuple[Dict[str, float], Dict[str, float]] = ({}, {})
    if k > 1:  # k samples of each prompt, consecutive, each with its own seed
        many = [r for r in evals for _ in range(k)] if driver else None
        s_k = collector.collect(many, replace(sampling, temperature=temperature), PASS_K_STREAM, step, score_env=True,
                                score_teachers=False)
        if driver:
            at_k = pass_and_mean_at_k(s_k.records, s_k.correct, k)
    kl: Dict[str, float] = {}
    if distill:
        s = collector.collect(mine, sampling, SAMPLED_STREAM, step, score_env=False, score_teachers=True)
        kl = reverse_kl(s)
    if not driver:
        return None
    # A teacher answers alone, in one turn: an agentic task's teachers answer through tools,
    # in episodes (their multi-turn accuracy is measured where the assets are built).
    single_turn = not collector.ctx.cfg.env.agentic.environment
    teacher_acc = collector.teacher_accuracy(evals) if tag == "start" and distill and single_turn else {}
    acc = accuracy_by_task(g.records, g.correct)
    rec = {"kind": "eval", "tag": tag, "step": step, "accuracy": acc, "accuracy_mean": mean_of(acc),
           "reverse_kl": kl, "time": time.time(), "teacher_accuracy": teacher_acc, "prompts": len(evals)}
    if k > 1:
        rec.update(k=k, pass_at_k=at_k[0], pass_at_k_mean=mean_of(at_k[0]), mean_at_k=at_k[1],
                   mean_at_k_mean=mean_of(at_k[1]))
    if g.info.get("agentic"):  # the evaluation's episodes: counted like a step's, never held to max_error_share
        rec["agentic"] = g.info["agentic"]
    collector.ctx.log.info("validation %s (step %d): accuracy %s; reverse KL %s%s", tag, step, fmt(acc), fmt(kl),
                           f"; pass@{k} {fmt(at_k[0])}; mean@{k} {fmt(at_k[1])}" if k > 1 else "")
    return rec

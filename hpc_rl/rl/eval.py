"""Evaluation on fixed prompts at the start and the end of a run: greedy accuracy per
task and, with teachers, the reverse KL of sampled answers to their routed teacher (and,
at the start, each teacher's own accuracy: what the student is distilled toward)."""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import torch

from hpc_rl.algo import reverse_kl_per_teacher
from hpc_rl.data.dataset import PromptRecord
from hpc_rl.engines.base import Sampling

from hpc_rl.messaging.messages import Batch
from .collect import Collector

GREEDY_STREAM, SAMPLED_STREAM = 2, 3  # seed streams of the eval collections (training uses 1)


def reverse_kl(b: Batch) -> Dict[str, float]:
    names = sorted(set(b.aliases))
    index = torch.tensor([names.index(a) for a in b.aliases])
    return reverse_kl_per_teacher(b.student_logprobs, b.teacher_logprobs, b.rollouts.response_mask, index, names)


def accuracy_by_task(records: Sequence[PromptRecord], correct: Optional[Sequence[Optional[bool]]]) -> Dict[str, float]:
    by: Dict[str, List[bool]] = {}
    for r, c in zip(records, correct or []):
        if c is not None:
            by.setdefault(r.agent, []).append(c)
    return {k: sum(v) / len(v) for k, v in sorted(by.items())}


def fmt(d: Dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in d.items()) or "-"


def evaluate(collector: Collector, tag: str, evals: List[PromptRecord], step: int, sampling: Sampling,
             distill: bool) -> Optional[dict]:
    """Every trainer rank calls it; the driver returns the eval record, the others None."""
    driver = collector.is_driver
    mine = evals if driver else None
    g = collector.collect(mine, sampling.greedy(), GREEDY_STREAM, step, score_env=True, score_teachers=False)
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
    rec = {"kind": "eval", "tag": tag, "step": step, "accuracy": acc, "reverse_kl": kl, "time": time.time(),
           "teacher_accuracy": teacher_acc, "prompts": len(evals)}
    if g.info.get("agentic"):  # the evaluation's episodes: counted like a step's, never held to max_error_share
        rec["agentic"] = g.info["agentic"]
    collector.ctx.log.info("eval %s: accuracy %s; reverse KL %s", tag, fmt(acc), fmt(kl))
    return rec

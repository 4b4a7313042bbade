"""The tiny tool-using teacher (`tiny_agentic:teacher_calc`): a tiny Llama trained on whole
calculator transcripts, the loss on the assistant turns only, and evaluated the way it will
be used, multi-turn through the episode code (HF greedy generation as the policy).

The transcripts are laid out by the same TokenHistory the episodes use (a scripted policy
that "generates" the reference turns), so the teacher is trained on exactly the token layout
it later sees: first prompt, its own ids, then the template's delta for the tool message.

Built by `python -m hpc_rl.models.assets agentic` (or on first use of a `tiny_agentic:` model
reference); cached like the other tiny assets, by its spec's hash (models/assets.py
AgenticAssetSpec).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from hpc_rl.data import tasks as task_gen

from .calculator import CalculatorEnv, calculate
from .contract import Limits, StepwiseEpisode
from .history import TokenHistory

EVAL_LIMITS = Limits(max_turns=4, max_tokens=256, max_tokens_per_turn=48, turn_timeout_s=None, episode_timeout_s=None)


def tool_call_text(prompt_task: dict) -> str:
    """The reference call for a calculator task: `[calculator(expression="37*58")]`."""
    a, b = [int(w.strip("?")) for w in prompt_task["prompt"].split() if w.strip("?").isdigit()]
    return f'[calculator(expression="{a}*{b}")]'


def encode_transcript(tok, task: dict) -> Tuple[List[int], List[int]]:
    """(input ids, labels) of the reference trajectory: call, tool answer, final answer; the
    labels cover the assistant's ids (and their <|end|>) only."""
    eos = tok.eos_token_id
    call = tool_call_text(task)
    h = TokenHistory(tok)
    messages = [{"role": "user", "content": task["prompt"]}]
    tools = CalculatorEnv.tools
    h.prompt(messages, tools)
    first = tok(call, add_special_tokens=False)["input_ids"] + [eos]
    h.add_policy(first, [0.0] * len(first), 0, 0)
    result = calculate(call[len('[calculator(expression="'):-len('")]')])
    messages += [{"role": "assistant", "content": call}, {"role": "tool", "content": result}]
    h.prompt(messages, tools)
    final = tok(result, add_special_tokens=False)["input_ids"] + [eos]
    h.add_policy(final, [0.0] * len(final), 0, 0)
    (row,) = h.rows()
    labels = [-100] * len(row.prompt_ids) + [t if m else -100 for t, m in zip(row.response_ids, row.loss_mask)]
    return row.prompt_ids + row.response_ids, labels


def _batch(tok, samples) -> Dict[str, torch.Tensor]:
    from hpc_rl.models.asset_models import _batch as padded

    return padded(tok, samples, encode_transcript)


def train_teacher(model, tok, spec, log: Callable[[str], None] = print) -> float:
    """SFT on freshly drawn calculator transcripts (the training seeds never reach the
    evaluation's: seed*100003+step against 10_000+)."""
    from hpc_rl.models.asset_models import train_steps

    return train_steps(model, lambda step: _batch(tok, task_gen.calculator(spec.batch, seed=spec.seed * 100003 + step)),
                       spec.steps, spec.lr, log)


def episode_accuracy(model, tok, n: int, seed: int = 10_000, limits: Limits = EVAL_LIMITS) -> dict:
    """Greedy multi-turn accuracy on held-out calculator tasks, run through the episode code."""
    from .local import HFPolicy
    from .runner import run_episodes

    episode = StepwiseEpisode(CalculatorEnv)
    batch = asyncio.run(run_episodes(task_gen.calculator(n, seed=seed), episode, HFPolicy(model, tok), limits, tok,
                                     max_inflight=1))
    m = batch.metrics()
    return {k: m[k] for k in ("accuracy", "mean_reward", "turns", "truncated", "errors", "tool_parse_errors",
                              "changed_policy_tokens", "siblings")}


def student_baseline(path: str, n: int = 64) -> dict:
    """The tiny student (`tiny:student` at `path`, which never saw the tool) on the same
    held-out episodes: what an agentic recipe starts from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return {"model": "tiny:student", **episode_accuracy(AutoModelForCausalLM.from_pretrained(path).eval(),
                                                        AutoTokenizer.from_pretrained(path), n)}


def build_agentic_assets(spec, root: Optional[Path] = None, log: Callable[[str], None] = print):
    """Find the cached calculator teacher (and students) for `spec` (models/asset_models.py
    AgenticAssetSpec) or build them; a teacher below `spec.min_accuracy` fails the build."""
    from hpc_rl.models.asset_cache import cached_build
    from hpc_rl.models.asset_models import ASSET_VERSION, new_model
    from hpc_rl.models.tokenizer import build_tokenizer

    def build(tmp: Path) -> dict:
        t0 = time.time()
        tok = build_tokenizer(tmp / "tokenizer")
        models = {}
        # the teacher, then the students: the same training for fewer steps (agentic recipes'
        # students have seen a little of the tool, as the tiny students have of every task)
        for name, steps, floor in [(spec.name, spec.steps, spec.min_accuracy)] + [(n, k, 0.0) for n, k in spec.students]:
            log(f"[assets] training {name} on calculator transcripts ({steps} steps)")
            t1 = time.time()
            model = new_model(spec.model, len(tok), tok, spec.seed)
            loss = train_teacher(model, tok, dataclasses.replace(spec, name=name, steps=steps), log)
            train_s = time.time() - t1
            acc = episode_accuracy(model, tok, spec.eval_samples)
            log(f"[assets] {name}: loss {loss:.3f}, greedy multi-turn {acc}")
            if acc["accuracy"] < floor:
                raise RuntimeError(f"{name}: greedy multi-turn accuracy {acc['accuracy']:.3f} < {floor}")
            model.save_pretrained(tmp / name, safe_serialization=True)
            tok.save_pretrained(tmp / name)
            models[name] = {"tasks": ["calculator"], "train_steps": steps, "final_loss": loss, "greedy_episodes": acc,
                            "params": sum(p.numel() for p in model.parameters()), "train_seconds": train_s}
        return {"version": ASSET_VERSION, "spec": dataclasses.asdict(spec), "models": models,
                "build_seconds": time.time() - t0}

    return cached_build(spec, root, build)

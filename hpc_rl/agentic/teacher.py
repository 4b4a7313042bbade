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
import json
import os
import shutil
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
    enc = [encode_transcript(tok, s) for s in samples]
    width = max(len(x) for x, _ in enc)
    ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(enc), width), -100, dtype=torch.long)
    attn = torch.zeros((len(enc), width), dtype=torch.long)
    for i, (x, y) in enumerate(enc):
        ids[i, :len(x)], labels[i, :len(y)], attn[i, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": attn}


def train_teacher(model, tok, spec, log: Callable[[str], None] = print) -> float:
    """SFT on freshly drawn calculator transcripts (the training seeds never reach the
    evaluation's: seed*100003+step against 10_000+)."""
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec.lr, total_steps=spec.steps, pct_start=0.1)
    model.train()
    loss = float("nan")
    for step in range(spec.steps):
        out = model(**_batch(tok, task_gen.calculator(spec.batch, seed=spec.seed * 100003 + step)))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()
        if step % 250 == 0 or step == spec.steps - 1:
            log(f"  step {step + 1}/{spec.steps} loss {loss:.3f}")
    model.eval()
    return loss


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


def student_baseline(n: int = 64) -> dict:
    """The tiny student (`tiny:student`, which never saw the tool) on the same held-out
    episodes: what an agentic recipe starts from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rl.rl.inputs import resolve_model_ref

    path = resolve_model_ref("tiny:student")
    return {"model": "tiny:student", **episode_accuracy(AutoModelForCausalLM.from_pretrained(path).eval(),
                                                        AutoTokenizer.from_pretrained(path), n)}


def build_agentic_assets(spec, root: Optional[Path] = None, log: Callable[[str], None] = print):
    """Find the cached calculator teacher for `spec` (models/assets.py AgenticAssetSpec) or
    build it; a build below `spec.min_accuracy` fails rather than being cached."""
    from hpc_rl.models.assets import ASSET_VERSION, Assets, default_root, new_model
    from hpc_rl.models.tokenizer import build_tokenizer

    root = Path(root or default_root())
    final = root / f"tiny-{spec.key()}"
    if (final / "manifest.json").exists():
        manifest = json.loads((final / "manifest.json").read_text())
        return Assets(final, {name: final / name for name in manifest["models"]}, manifest)
    tmp = root / f".tiny-{spec.key()}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    tok = build_tokenizer(tmp / "tokenizer")
    models = {}
    # the teacher, then the students: the same training for fewer steps (agentic recipes'
    # students have seen a little of the tool, as the tiny students have of every task)
    for name, steps, floor in [(spec.name, spec.steps, spec.min_accuracy)] + [(n, k, 0.0) for n, k in spec.students]:
        one = dataclasses.replace(spec, name=name, steps=steps)
        log(f"[assets] training {name} on calculator transcripts ({steps} steps)")
        t1 = time.time()
        model = new_model(spec.model, len(tok), tok, spec.seed)
        loss = train_teacher(model, tok, one, log)
        train_s = time.time() - t1
        acc = episode_accuracy(model, tok, spec.eval_samples)
        log(f"[assets] {name}: loss {loss:.3f}, greedy multi-turn {acc}")
        if acc["accuracy"] < floor:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"{name}: greedy multi-turn accuracy {acc['accuracy']:.3f} < {floor}")
        model.save_pretrained(tmp / name, safe_serialization=True)
        tok.save_pretrained(tmp / name)
        models[name] = {"tasks": ["calculator"], "train_steps": steps, "final_loss": loss, "greedy_episodes": acc,
                        "params": sum(p.numel() for p in model.parameters()), "train_seconds": train_s}
    manifest = {"version": ASSET_VERSION, "spec": dataclasses.asdict(spec), "models": models,
                "build_seconds": time.time() - t0}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    root.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, final)
    except OSError:  # another process finished first: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return build_agentic_assets(spec, root, log)

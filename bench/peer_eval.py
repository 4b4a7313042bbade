"""The peer bench's held-out evaluator (bench/peer_trl.py): one evaluator for both sides, so
neither side's own sampler enters the comparison of what the weights learned."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

MAX_NEW = 16  # bench/peer_trl.py's new tokens per answer


def greedy_accuracy(model_dir: str, tokenizer_dir: str, heldout: Path, batch: int = 64, samples: int = 8) -> Dict:
    """Greedy answers of the weights in model_dir (transformers, fp32), scored by the verifier; and
    the mean reward of `samples` sampled answers per held-out prompt (temperature 1, a fixed seed):
    the same evaluator for both sides, so neither side's own sampler or its draws of training prompts
    enter the comparison (the training reward per step moves by +-0.1 with the prompts drawn)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rl.envs.registry import score

    rows = [json.loads(x) for x in heldout.read_text().splitlines() if x.strip()]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    correct: Dict[str, List[bool]] = {}
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                         add_generation_prompt=True) for r in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        for r, ids in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
            text = tok.decode(ids, skip_special_tokens=True)
            correct.setdefault(r["task"], []).append(bool(score(r["task"], text, r["answer"]).correct))
    allc = [c for v in correct.values() for c in v]
    torch.manual_seed(1234)
    rewards: List[float] = []
    for i in range(0, len(rows), batch // samples):
        chunk = rows[i:i + batch // samples]
        texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                         add_generation_prompt=True) for r in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=samples,
                                 max_new_tokens=MAX_NEW, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for k, ids in enumerate(out[:, enc["input_ids"].shape[1]:]):
            r = chunk[k // samples]
            rewards.append(float(score(r["task"], tok.decode(ids, skip_special_tokens=True), r["answer"]).reward))
    return {"accuracy": sum(allc) / len(allc), "n": len(allc),
            "by_task": {k: sum(v) / len(v) for k, v in correct.items()},
            "sampled_reward": sum(rewards) / len(rewards), "sampled_n": len(rewards)}

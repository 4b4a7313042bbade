"""A train step longer than the default refit deadline, on a model of real size (issue 31).

A user ran tiny_grpo on SmolLM2-135M-Instruct with default settings and the run died at
step 2: the generator's refit deadline (refit.timeout_s=120) ran while the trainer spent
149 s in its train step. This machine has no hub access, so the model here is a random
Llama of SmolLM2-135M's body (hidden 576, 30 layers, 9 heads of 64, MLP 1536; about 120M
parameters with the project's small tokenizer, so no 28M-parameter embedding), saved as a
real checkpoint. Answers are pinned to `--tokens` tokens (min_tokens = max_tokens) so the
train step is long for certain. Default refit settings; the run must finish.

Writes bench/results/real_size_refit.json: per step the trainer's train and refit seconds,
the generator's wait for the trainer (phase wait_refit) and its refit, against
refit.timeout_s.

    python bench/real_size_refit.py [--steps 3] [--prompts 16] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hpc_rl.config.schema import RefitConfig  # noqa: E402
from hpc_rl.models.assets import ModelSpec, save_untrained  # noqa: E402

OUT = ROOT / "bench" / "results" / "real_size_refit.json"
SMOL_BODY = ModelSpec(hidden=576, intermediate=1536, layers=30, heads=9, max_positions=256)


def _timing(run: Path, name: str) -> dict:
    rows = [json.loads(x) for x in (run / "timing" / name).read_text().splitlines()]
    return {r["step"]: r for r in rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="real_size_refit-"))
    t0 = time.time()
    ckpt = save_untrained(work / "smol_body", SMOL_BODY, seed=0)
    import safetensors.torch

    params = sum(t.numel() for f in ckpt.glob("*.safetensors") for t in safetensors.torch.load_file(f).values())
    run = work / "run"
    overrides = ["+recipe=tiny_grpo", f"model.path={ckpt}", "model.name=smol-body-random", f"model.params_b={params / 1e9:.3f}",
                 f"run.max_steps={args.steps}", f"run.dir={run}", f"algo.prompts_per_step={args.prompts}",
                 f"trainer.global_batch_size={args.prompts * 8}", "trainer.micro_batch_size=8",
                 f"generator.sampling.min_tokens={args.tokens}", f"generator.sampling.max_tokens={args.tokens}",
                 "data.eval_prompts_per_task=0", "checkpoint.every_steps=1000"]
    print("launching:", " ".join(overrides), flush=True)
    t_launch = time.time()
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", *overrides], capture_output=True, text=True)
    wall = time.time() - t_launch
    print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
    result = {"what": "tiny_grpo on a random Llama of SmolLM2-135M's body, default refit settings", "params": params,
              "refit_timeout_s": RefitConfig().timeout_s, "overrides": overrides, "rc": proc.returncode,
              "finished": (run / "FINISHED").exists(), "wall_s": round(wall, 1),
              "checkpoint_build_s": round(t_launch - t0, 1), "steps": []}
    if (run / "timing").exists():
        trainer, generator = _timing(run, "trainer.0.0.jsonl"), _timing(run, "generator.0.0.jsonl")
        for step in sorted(trainer):
            t, g = trainer[step]["phases"], generator.get(step, {}).get("phases", {})
            result["steps"].append({"step": step, "trainer_train_s": t.get("train"), "trainer_logprobs_s": t.get("logprobs"),
                                    "trainer_refit_s": t.get("refit"), "generator_wait_refit_s": g.get("wait_refit"),
                                    "generator_refit_s": g.get("refit"), "step_s": trainer[step]["step_s"]})
    if proc.returncode != 0:
        result["error_tail"] = proc.stderr[-2000:]
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())

"""The TRL side of bench/peer_trl.py: one GRPOTrainer run, timed, in its own interpreter.

Run by bench/peer_trl.py (with an interpreter that has TRL, often a venv beside the
project's: TRL is a bench-only dependency). Reads a JSON spec (argv[1]), trains, saves the
final weights and writes a JSON result (argv[2]): per optimizer step the wall seconds, the
seconds in TRL's `_generate_and_score_completions` (rollout: tokenizing, generation, reward,
advantages), in its pure generation (`_generate_single_turn`: transformers' generate) and in
the reward functions; the rest of the step is training (forward/backward of the
micro-batches, the optimizer step). Rewards come from the project's verifier
(hpc_rl.envs.registry.score), the same call the project's env rank makes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRL_VERSION = "1.16.0"


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    try:
        import trl
    except ImportError:
        sys.stderr.write(f"TRL is not installed for {sys.executable}: pip install trl=={TRL_VERSION}\n")
        return 3
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hpc_rl.envs.registry import score

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    rows = [json.loads(line) for line in Path(spec["train_jsonl"]).read_text().splitlines() if line.strip()]
    need = spec["steps"] * spec["prompts"]
    rows = (rows * (need // len(rows) + 1))[:need]  # the project's order (data.shuffle=false), one pass
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"],
                             "task": r["task"]} for r in rows])

    step_rewards: list = []

    step_prompts: list = []

    def verifier_reward(prompts, completions, answer, task, **_):
        step_prompts.append(sorted({p[-1]["content"] if isinstance(p, list) else p for p in prompts}))
        out = []
        for c, a, t in zip(completions, answer, task):
            text = c[-1]["content"] if isinstance(c, list) else c
            out.append(float(score(t, text, a).reward))
        step_rewards.append(out)
        return out

    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    group, micro = spec["group"], spec["micro_batch"]
    batch = spec["prompts"] * group
    if batch % micro:
        raise SystemExit(f"prompts x group ({batch}) must be a multiple of the micro-batch ({micro})")
    cfg = GRPOConfig(
        output_dir=str(Path(spec["out_dir"]) / "trl_out"), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, seed=spec["seed"], data_seed=spec["seed"],
        max_steps=spec["steps"], per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        num_generations=group, num_iterations=1, max_completion_length=spec["max_new_tokens"],
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="dapo",
        scale_rewards="group", mask_truncated_completions=False, shuffle_dataset=False,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1], adam_epsilon=spec["eps"],
        weight_decay=spec["weight_decay"], max_grad_norm=spec["grad_clip"],
        logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False)

    marks = {"rollout": [], "generate": [], "reward": []}

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends, self.walls = [], []
            self.start = None
            self.logs = []

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()
            self.start_wall = time.time()

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())
            self.walls.append(time.time())

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=[verifier_reward], args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[clock])

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                marks[name].append(time.perf_counter() - t0)
        return wrapper

    trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)
    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    final = Path(spec["out_dir"]) / "final_hf"
    trainer.save_model(str(final))
    edges = [clock.start] + clock.ends
    steps = []
    for i in range(len(clock.ends)):
        step_s = edges[i + 1] - edges[i]
        r = step_rewards[i] if i < len(step_rewards) else []
        rollout = marks["rollout"][i] if i < len(marks["rollout"]) else None
        steps.append({"step": i + 1, "step_s": step_s, "rollout_s": rollout,
                      "generate_s": marks["generate"][i] if i < len(marks["generate"]) else None,
                      "reward_s": marks["reward"][i] if i < len(marks["reward"]) else None,
                      "train_s": step_s - rollout if rollout is not None else None,
                      "reward_mean": sum(r) / len(r) if r else None, "samples": len(r)})
    logs = [x for x in clock.logs if "completions/mean_length" in x or "reward" in x]
    out = {"trl_version": trl.__version__, "torch_threads": torch.get_num_threads(), "wall_train_s": wall,
           "steps": steps, "step_end_wall": [clock.start_wall] + clock.walls,
           "step_prompts": step_prompts, "final_hf": str(final), "logs": logs, "python": sys.executable,
           "config": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                      for k, v in cfg.to_dict().items()
                      if k in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
                               "steps_per_generation", "generation_batch_size", "num_iterations", "loss_type",
                               "beta", "epsilon", "epsilon_high", "scale_rewards", "learning_rate",
                               "lr_scheduler_type", "optim", "adam_beta1", "adam_beta2", "adam_epsilon",
                               "weight_decay", "max_grad_norm", "max_completion_length", "temperature", "top_p",
                               "top_k", "gradient_checkpointing", "bf16", "use_vllm", "shuffle_dataset", "seed")}}
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

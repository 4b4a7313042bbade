"""The separate old-log-prob pass against taking them from the training forward (issue 49).

One process, one gloo rank: two fsdp2 students built from the same untrained Llama, each
trained on the same GRPO batch (8 prompts x 8 samples by default, PPO loss, TIS weights,
one optimizer step per batch, micro-batches of 16 as tiny_grpo) through TrainerRole.train,
alternating: "separate_pass" runs the no-grad log-prob pass over the batch first (what a
collection did before), "training_forward" skips it (roles/old_logprobs.py). Recorded per
path: the median and the least seconds of the pass, the train step and their sum over --steps warm steps
(one warm-up step each first), and the two paths' first-step loss and largest gradient
difference (same weights, same batch).

    python bench/logprob_pass.py [--hidden 256] [--layers 4] [--rows 64] [--prompt 16] [--response 48]
                                 [--steps 5] [--out bench/results/logprob_pass.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc_rl.config import load_config  # noqa: E402
from hpc_rl.models.assets import ModelSpec, save_untrained  # noqa: E402
from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig  # noqa: E402
from hpc_rl.roles.trainer import TrainerRole  # noqa: E402


def _role(cfg, ckpt: str) -> TrainerRole:
    role = TrainerRole.__new__(TrainerRole)
    role.cfg = cfg
    role.backend = FSDP2Backend(ckpt, optim=OptimConfig(lr=1e-4))
    role.ctx = SimpleNamespace(groups=SimpleNamespace(role=dist.group.WORLD))
    return role


def _batch(rows: int, prompt: int, response: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = prompt + response
    ids = torch.randint(8, 100, (rows, t), generator=g)
    attn = torch.ones_like(ids)
    lengths = torch.randint(response // 2, response + 1, (rows,), generator=g)  # responses end at EOS or the limit
    for i, n in enumerate(lengths.tolist()):
        attn[i, prompt + n:] = 0
    mask = attn.bool().clone()
    mask[:, :prompt] = False
    rewards = (torch.rand(rows, generator=g) < 0.4).float()
    return ids, attn, mask, rewards


def _step(role: TrainerRole, ids, attn, mask, rewards, gen, separate: bool):
    """One RL step's trainer work: the separate pass (when it runs), then the train step."""
    grads = {}
    apply = role.backend.optimizer.step

    def step(*a, **k):
        grads.update({n: p.grad.detach().clone() for n, p in role.backend.model.named_parameters()})
        return apply(*a, **k)

    role.backend.optimizer.step = step
    t0 = time.perf_counter()
    lp = role.backend.logprobs(ids, attn).float() if separate else None
    t1 = time.perf_counter()
    rows = [SimpleNamespace(version_first=0, version_last=0) for _ in range(ids.shape[0])]
    batch = SimpleNamespace(rows=rows, items=len(rows), sibling_of=[], student_logprobs=lp, rewards=rewards,
                            advantages=None, teacher_logprobs=None,
                            rollouts=SimpleNamespace(response_mask=mask, generation_logprobs=gen, input_ids=ids,
                                                     attention_mask=attn))
    return batch, t0, t1, grads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--response", type=int, default=48)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench/results/logprob_pass.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="logprob_pass_"))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "store"), 1), rank=0, world_size=1)
    spec = ModelSpec(hidden=args.hidden, intermediate=3 * args.hidden, layers=args.layers, heads=args.hidden // 64,
                     max_positions=max(256, args.prompt + args.response))
    ckpt = str(save_untrained(tmp / "model", spec, seed=0))
    cfg = load_config(["+recipe=tiny_grpo", f"algo.prompts_per_step={args.rows // args.group}",
                       f"algo.generations_per_prompt={args.group}", f"trainer.global_batch_size={args.rows}",
                       f"trainer.micro_batch_size={args.micro}", "algo.loss.kind=ppo", "algo.mismatch.kind=tis"])
    roles = {"separate_pass": _role(cfg, ckpt), "training_forward": _role(cfg, ckpt)}
    params = sum(p.numel() for p in roles["separate_pass"].backend.model.parameters())
    times = {k: {"pass_s": [], "train_s": [], "total_s": []} for k in roles}
    first = {}
    for s in range(args.steps + 1):  # step 0: the warm-up (and the equivalence check)
        ids, attn, mask, rewards = _batch(args.rows, args.prompt, args.response, args.group, seed=s)
        # the engine's log-probs: the step's trainer log-probs plus noise (outside the timing)
        gen = roles["separate_pass"].backend.logprobs(ids, attn).float()
        gen = gen + 0.02 * torch.randn(gen.shape, generator=torch.Generator().manual_seed(100 + s))
        order = list(roles) if s % 2 == 0 else list(reversed(roles))  # neither always first
        for name in order:
            role = roles[name]
            batch, t0, t1, grads = _step(role, ids, attn, mask, rewards, gen, separate=name == "separate_pass")
            m = role.train(batch)
            t2 = time.perf_counter()
            assert m["old_logprobs_path"] == name, m["old_logprobs_path"]
            if s == 0:
                first[name] = {"loss": m["loss"], "grads": grads}
            else:
                times[name]["pass_s"].append(t1 - t0)
                times[name]["train_s"].append(t2 - t1)
                times[name]["total_s"].append(t2 - t0)
    a, b = first["separate_pass"], first["training_forward"]
    grad_diff = max(float((a["grads"][n] - b["grads"][n]).abs().max()) for n in a["grads"])
    grad_scale = max(float(g.abs().max()) for g in a["grads"].values())
    med = {k: {f: statistics.median(v) for f, v in t.items()} for k, t in times.items()}
    # the machine is shared: the fastest step of each path is the least disturbed figure
    best = {k: {f: min(v) for f, v in t.items()} for k, t in times.items()}
    sep, fwd = med["separate_pass"]["total_s"], med["training_forward"]["total_s"]
    out = {"bench": "logprob_pass", "issue": 49, "host": platform.node(), "threads": args.threads,
           "model": {"params": params, "hidden": args.hidden, "layers": args.layers},
           "batch": {"rows": args.rows, "group": args.group, "prompt_tokens": args.prompt,
                     "response_tokens_max": args.response, "micro_batch_size": args.micro, "optimizer_steps": 1},
           "steps_timed": args.steps, "median_s": med, "min_s": best, "raw_s": times,
           "speedup_trainer_step": sep / fwd, "saved_s_per_step": sep - fwd,
           "speedup_trainer_step_min": best["separate_pass"]["total_s"] / best["training_forward"]["total_s"],
           "first_step": {"loss_separate_pass": a["loss"], "loss_training_forward": b["loss"],
                          "grad_max_abs_diff": grad_diff, "grad_max_abs": grad_scale}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("median_s", "min_s", "speedup_trainer_step", "speedup_trainer_step_min",
                                          "saved_s_per_step", "first_step")},
                     indent=1))


if __name__ == "__main__":
    main()

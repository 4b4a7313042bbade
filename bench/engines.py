"""Generation throughput and refit time of vLLM CPU engines of tensor parallel 1 and 2.

One fp32 Llama checkpoint (hidden 512, FFN 1536, 5 layers, 8 heads: 68 MB, built here) is
served in turn by each engine configuration; one engine is alive at a time. The blocks are
interleaved (tp1, tp2, tp1_2cores, tp1, tp2, ...: --rounds of them) so that drift on this
shared 2-core machine shows in every configuration alike. Configurations:
  tp1         TP 1 with vLLM's own CPU binding: on 2 cores it keeps one core for the
              scheduler, so the worker computes on one core (what a default TP-1 engine gets)
  tp2         TP 2, one core per worker (the engine's `bind_cpu_workers`: "0|1")
  tp1_2cores  TP 1 bound to both cores ("0,1"): the same cores as tp2, one worker
Per block: the engine's start, a warm-up batch, a first refit that also joins the refit
group, then --trials rounds of (a generation batch, a refit reusing the group).
  generation  --prompts prompts, one fixed seed each, min_tokens == max_tokens so every
              engine generates exactly prompts x max_tokens tokens; tokens/s = those tokens
              / wall seconds of `sample`
  refit       `refit_in_process` of the checkpoint's own fp32 state dict (the same weights):
              refit_s (sender's view: start to the engine's return), send_s, the engine's
              timings and the bytes its workers received
Correctness, per block: every batch uses the same seeds, so after refits of the same
weights each batch must repeat the warm-up's tokens and logprobs; and token_mult_prob_error
of the engine's logprobs against an HF fp32 forward, before any refit (the warm-up) and
after the last one.

    python bench/engines.py [--rounds 2] [--trials 3] [--prompts 32] [--max-tokens 64]
Writes bench/results/engines.json by default.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden=512, intermediate=1536, layers=5, heads=8, max_positions=256)
# tp, VLLM_CPU_OMP_THREADS_BIND (None: unset, so vLLM or the engine picks)
CONFIGS = {"tp1": (1, None), "tp2": (2, None), "tp1_2cores": (1, "0,1")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hf_error(model, rows, pad_id: int) -> float:
    """token_mult_prob_error of the engine's sampled-token logprobs against an HF fp32 forward."""
    import torch

    from hpc_rl.algo.metrics import token_mult_prob_error
    from hpc_rl.models.fsdp2 import token_logprobs
    from hpc_rl.refit.vllm_engine import pad_rows

    r = pad_rows(rows, pad_id)
    with torch.no_grad():
        logits = model(input_ids=r.input_ids, attention_mask=r.attention_mask).logits
    return token_mult_prob_error(token_logprobs(logits, r.input_ids), r.generation_logprobs, r.response_mask)


def _compare(a, b) -> dict:
    """How far batch b is from batch a (same prompts, same seeds): tokens and logprobs."""
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra.response_ids, rb.response_ids))
    total = sum(len(r.response_ids) for r in a)
    diffs = [abs(x - y) for ra, rb in zip(a, b) if ra.response_ids == rb.response_ids
             for x, y in zip(ra.logprobs, rb.logprobs)]
    return {"tokens_identical": same / total, "max_abs_logprob_diff": max(diffs, default=None)}


def run_block(name: str, ckpt: Path, model, state, store, port: int, prompts_raw, args, tag: str) -> dict:
    from hpc_rl.refit.vllm_engine import VLLMGenerator, refit_in_process

    tp, bind = CONFIGS[name]
    saved = os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    try:
        gen = VLLMGenerator(str(ckpt), precision="fp32", max_model_len=256, memory_fraction=0.1,
                            max_num_seqs=args.prompts, tensor_parallel=tp)
        used_bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    finally:
        # the next block's engine must not inherit this one's binding (tp2 leaves "0|1" behind)
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        if saved is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
    start_s = time.perf_counter() - t0
    prompts = gen.chat_prompts(prompts_raw)
    seeds = list(range(1000, 1000 + len(prompts)))
    pad_id = gen.tokenizer.pad_token_id or 0

    def batch(gen):
        t = time.perf_counter()
        rows = gen.sample(prompts, temperature=1.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens, seed=seeds)
        wall = time.perf_counter() - t
        n = sum(len(r.response_ids) for r in rows)
        if n != len(prompts) * args.max_tokens:
            raise RuntimeError(f"{name}: {n} tokens generated, not {len(prompts)} x {args.max_tokens}")
        return rows, {"wall_s": wall, "tokens": n, "tokens_per_s": n / wall}

    warm, warm_t = batch(gen)
    hf_before = _hf_error(model, warm, pad_id)
    first, endpoint = refit_in_process(gen, store, port, state, version=1, prefix=f"engines/{tag}")
    gens, refits, checks = [], [], []
    for trial in range(args.trials):
        rows, g = batch(gen)
        gens.append(g)
        checks.append(_compare(warm, rows))
        r, endpoint = refit_in_process(gen, store, port, state, version=trial + 2, prefix=f"engines/{tag}",
                                       endpoint=endpoint)
        refits.append(r)
    rows, _ = batch(gen)  # after the last refit
    checks.append(_compare(warm, rows))
    hf_after = _hf_error(model, rows, pad_id)
    version = gen.worker_version()
    gen.llm.llm_engine.engine_core.shutdown()
    del gen
    gc.collect()
    left = [p.name for p in mp.active_children()]
    out = {"config": name, "tensor_parallel": tp, "omp_threads_bind": used_bind, "engine_start_s": start_s,
           "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
           "warmup": warm_t, "generation": gens, "first_refit_with_join": first, "refits": refits,
           "engine_weight_version": version, "children_left_after_shutdown": left,
           "same_seeds_vs_warmup": checks, "hf_token_mult_prob_error": {"before_refit": hf_before,
                                                                        "after_refits": hf_after},
           "warmup_response_ids": [r.response_ids for r in warm]}
    print(f"{tag}: start {start_s:.1f}s, tokens/s " + ", ".join(f"{g['tokens_per_s']:.0f}" for g in gens) +
          "; refit s " + ", ".join(f"{r['refit_s']:.3f}" for r in refits) +
          f"; hf error {hf_before:.6f} -> {hf_after:.6f}; load {os.getloadavg()[0]:.2f}", flush=True)
    return out


def _stats(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(blocks, names) -> dict:
    out = {}
    for name in names:
        mine = [b for b in blocks if b["config"] == name]
        refits = [r for b in mine for r in b["refits"]]
        checks = [c for b in mine for c in b["same_seeds_vs_warmup"]]
        out[name] = {
            "tokens_per_s": _stats([g["tokens_per_s"] for b in mine for g in b["generation"]]),
            "refit_s": _stats([r["refit_s"] for r in refits]),
            "send_s": _stats([r["send_s"] for r in refits]),
            "engine_refit_s": _stats([r["engine"]["refit_s"] for r in refits]),
            "first_refit_with_join_s": _stats([b["first_refit_with_join"]["join_s"] +
                                               b["first_refit_with_join"]["refit_s"] for b in mine]),
            "join_s": _stats([b["first_refit_with_join"]["join_s"] for b in mine]),
            "engine_start_s": _stats([b["engine_start_s"] for b in mine]),
            "bytes_received_per_refit": sorted({r["engine"]["bytes"] for r in refits}),
            "messages_per_refit": sorted({r["engine"]["messages"] for r in refits}),
            "same_weights_tokens_identical_min": min(c["tokens_identical"] for c in checks),
            "same_weights_max_abs_logprob_diff": max(c["max_abs_logprob_diff"] or 0.0 for c in checks),
            "hf_token_mult_prob_error_max": max(max(b["hf_token_mult_prob_error"].values()) for b in mine),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2, help="blocks per configuration, interleaved")
    ap.add_argument("--trials", type=int, default=3, help="generation batches and refits per block")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default="tp1,tp2,tp1_2cores")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engines.json"))
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hpc_rl.data.tasks import mixed
    from hpc_rl.models.assets import ModelSpec, save_untrained

    names = args.configs.split(",")
    t_all = time.perf_counter()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="hpc_rl_engines_") as tmp:
        ckpt = Path(tmp) / "model"
        save_untrained(ckpt, ModelSpec(**SHAPE), seed=0)
        model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model_bytes = sum(v.numel() * v.element_size() for v in state.values())
        prompts_raw = [s["prompt"] for s in mixed(args.prompts // 2, seed=3, tasks=("addition", "multiplication"))]
        port = _free_port()
        store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=300),
                              wait_for_workers=False)
        blocks = []
        for rnd in range(args.rounds):
            for name in names:
                blocks.append(run_block(name, ckpt, model, state, store, port, prompts_raw, args, f"{name}/{rnd}"))
    summary = summarize(blocks, names)
    # do the engines sample the same tokens from the same seeds? (not bitwise: reductions differ)
    first = {b["config"]: b["warmup_response_ids"] for b in reversed(blocks)}
    cross = {}
    for name in names[1:]:
        pairs = [(x, y) for ra, rb in zip(first[names[0]], first[name]) for x, y in zip(ra, rb)]
        cross[f"{names[0]}_vs_{name}"] = sum(x == y for x, y in pairs) / len(pairs)
    for b in blocks:
        del b["warmup_response_ids"]
    doc = {"benchmark": "engines", "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": f"{os.cpu_count()} CPU cores, no GPU; shared with other work", "torch": torch.__version__,
           "load_avg_start": load_start, "load_avg_end": os.getloadavg(), "total_s": time.perf_counter() - t_all,
           "model": {"shape": "Llama " + ", ".join(f"{k} {v}" for k, v in SHAPE.items()) + " (random, built here)",
                     "dtype": "float32", "bytes": model_bytes, "tensors": len(state)},
           "settings": {"rounds": args.rounds, "trials": args.trials, "prompts": args.prompts,
                        "max_tokens": args.max_tokens, "min_tokens": args.max_tokens, "temperature": 1.0,
                        "order": [b["config"] for b in blocks], "engine_memory_fraction": 0.1},
           "summary": summary, "warmup_tokens_identical_across_engines": cross, "blocks": blocks}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    for name, s in summary.items():
        print(f"{name}: tokens/s {s['tokens_per_s']['median']:.0f} ({s['tokens_per_s']['min']:.0f}-"
              f"{s['tokens_per_s']['max']:.0f}), refit {s['refit_s']['median']:.3f}s ({s['refit_s']['min']:.3f}-"
              f"{s['refit_s']['max']:.3f}), bytes {s['bytes_received_per_refit']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from hpc_rl.runtime.signed_store import ensure_job_key

    ensure_job_key()  # standalone: no launcher made the job's secret (store values, messages)
    sys.exit(main())

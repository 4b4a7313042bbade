"""The plan-time memory model (hpc_rl/memory/, issue 44) against the fsdp2 trainer's measured
peak, on CPU, for several shapes.

Each case is a random Llama (transformers' LlamaConfig) saved as a checkpoint, then, in a fresh
subprocess with one torch thread: two train steps of a tiny model of the same family (the code
paths' one-time costs: library pages a first step touches, thread pools, allocator arenas, about
230 MB here, are no tensor the plan holds), the baseline, then FSDP2Backend built from the case's
checkpoint (one rank, no process group, fp32),
a first train step of 16 tokens (it creates AdamW's state: the plan is for steady state), then
the measured train step on one sequence of the case's tokens (forward with the chunked log-prob
head, backward, gradient clipping, AdamW's step). Memory is the process's resident set from
/proc/self/status: VmHWM (the peak) is reset through /proc/self/clear_refs right before the
measured step, and once more when the optimizer step begins, so the forward/backward and the
optimizer step each have their own peak. The figure compared is the larger peak minus VmRSS
right before the backend is built (after the tiny model's steps), so
it holds the weights, gradients, optimizer state, activations and temporaries, as the model's
does. glibc's mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_) so freed tensors leave the
resident set. torch's allocator gives no peak figures on CPU.

The prediction is hpc_rl.memory.model.trainer() for the shape read from the checkpoint's
config.json (hpc_rl.memory.shape.from_hf), kind trainer, backend fsdp2, fp32, every parallel size
1, device cpu, the step's tokens; the phases the bench does not run (the no-grad log-prob pass)
are left out of the prediction by giving it 0 tokens. No coefficient is fitted: the formulas
count the tensors the code keeps (hpc_rl/memory/model.py's docstrings). The `dev` cases were run
while the formulas were written; the `validation` cases, other shapes, are the reported check.

    python bench/memory_model.py [--cases dev validation] [--out bench/results/memory_model.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# the resident-set readings of /proc (VmRSS, VmHWM and its reset), as the log-prob memory bench takes them
from logprob_memory import _reset_peak, _status  # noqa: E402

# name -> hidden, layers, heads, kv heads, intermediate, vocab, tokens, activation checkpointing
CASES = {
    "dev": {
        "d1_h256_l4_v32k_t2048": (256, 4, 4, 4, 1024, 32768, 2048, False),
        "d2_h256_l4_v32k_t2048_ac": (256, 4, 4, 4, 1024, 32768, 2048, True),
        "d3_h512_l2_v64k_t1024": (512, 2, 8, 8, 1408, 65536, 1024, False),
        # the shape the first validation run's gap was diagnosed on (saved tensors by storage, an RSS
        # timeline of the step): the norms' third tensor, o_proj's input being the attention output,
        # and the head's backward holding two chunks (models/chunked_logprobs.py, fixed)
        "d4_h512_l4_v40k_t4096": (512, 4, 8, 8, 1536, 40000, 4096, False),
    },
    "validation": {
        "v1_h512_l8_v32k_t4096": (512, 8, 8, 8, 1408, 32000, 4096, False),
        "v2_h512_l8_v32k_t4096_ac": (512, 8, 8, 8, 1408, 32000, 4096, True),
        "v3_h640_l4_gqa_v128k_t1024": (640, 4, 10, 2, 1792, 128256, 1024, False),
        "v4_h768_l6_v64k_t2048_ac": (768, 6, 12, 12, 2048, 65536, 2048, True),
        "v5_h384_l8_gqa_v50k_t3072": (384, 8, 6, 2, 1024, 50000, 3072, False),
    },
}
WARMUP_TOKENS = 16
# The validation cases' first run (the same shapes and bench), before two corrections. Its three
# backward-peaked cases were under-predicted (ratios 0.80-0.87, still within 20%). On a dev shape
# (d4), counting the saved tensors by storage and an RSS timeline of the step showed: (1) a norm keeps
# three H-sized tensors (input, normalised input, output), not two, and o_proj's input is the
# attention output itself, not a copy; the model counted one tensor per MLP mixer too few; (2) the
# chunked head's backward held the previous chunk's buffer while computing the next (no `del`), so
# two chunks lived at once: fixed in models/chunked_logprobs.py, which the model always described.
FIRST_RUN = {
    "ratios_before_the_corrections": {"v1_h512_l8_v32k_t4096": 0.874, "v2_h512_l8_v32k_t4096_ac": 0.803,
                                      "v3_h640_l4_gqa_v128k_t1024": 0.996, "v4_h768_l6_v64k_t2048_ac": 0.997,
                                      "v5_h384_l8_gqa_v50k_t3072": 0.837},
    "corrections": ["hpc_rl/memory/model.py: a transformers RMSNorm keeps (4 + 2a) x H bytes per token, the "
                    "attention output is o_proj's input", "hpc_rl/models/chunked_logprobs.py: `del g, h` at the "
                    "end of each backward chunk (one chunk's logits at a time, as its docstring says)"],
}
MB = 2**20


def _checkpoint(path: Path, hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tokens: int) -> str:
    """A random Llama saved with the tiny tokenizer (the backend's checkpoint check wants one;
    the ids here are random, so its vocabulary need not match)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_rl.models.tokenizer import build_tokenizer

    torch.manual_seed(0)
    build_tokenizer(path)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=tokens + 8,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


def predict(ckpt: str, tokens: int, ac: bool) -> dict:
    from hpc_rl.memory.model import Setup, trainer
    from hpc_rl.memory.shape import from_hf, params

    shape = from_hf(json.loads((Path(ckpt) / "config.json").read_text()))
    setup = Setup(kind="trainer", backend="fsdp2", precision="fp32", parallel={}, device="cpu", train_tokens=tokens,
                  logprob_tokens=0, recompute=ac)
    m = trainer(shape, setup)
    return {"params": params(shape).total, "peak_mb": round(m.peak / MB, 1), "phase": m.phase,
            "parts_mb": {k: round(v / MB, 1) for k, v in m.parts.items()},
            "activations_full_mb": round(m.activations_full / MB, 1),
            "activations_recompute_mb": round(m.activations_recompute / MB, 1)}


def _train(backend, tokens: int, vocab: int) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    backend.train_step(ids, torch.ones_like(ids), lambda lp, rows: (-lp.mean(), {}))


def run_case(ckpt: str, warm_ckpt: str, tokens: int, ac: bool) -> dict:
    """One measurement, in this (fresh) process."""
    import gc

    import torch

    from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig

    torch.set_num_threads(1)
    # Before the baseline, two steps of a tiny model of the same family and settings run the same code
    # paths once: the pages of torch's and its kernels' libraries (file-backed, in the resident set)
    # that a first train step touches, thread pools and allocator arenas are not the model's memory.
    warm = FSDP2Backend(warm_ckpt, optim=OptimConfig(lr=1e-4), activation_checkpointing=ac)
    for _ in range(2):
        _train(warm, 64, warm.model.config.vocab_size)
    del warm
    gc.collect()
    base = _status("VmRSS")
    b = FSDP2Backend(ckpt, optim=OptimConfig(lr=1e-4), activation_checkpointing=ac)
    built = _status("VmRSS")
    vocab = b.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    attn = torch.ones_like(ids)
    loss = lambda lp, rows: (-lp.mean(), {})  # noqa: E731
    b.train_step(ids[:, :WARMUP_TOKENS], attn[:, :WARMUP_TOKENS], loss)  # creates AdamW's state
    warmed = _status("VmRSS")
    marks = {}
    real_step = b.optimizer.step

    def step(*args, **kw):  # the forward/backward's peak, then the optimizer step's own
        marks["fwd_bwd"] = _status("VmHWM")
        _reset_peak()
        out = real_step(*args, **kw)
        marks["step"] = _status("VmHWM")
        return out

    b.optimizer.step = step
    _reset_peak()
    t0 = time.perf_counter()
    b.train_step(ids, attn, loss)
    seconds = time.perf_counter() - t0
    peak = max(marks.values())
    return {"baseline_rss_mb": round(base / MB, 1), "after_build_mb": round((built - base) / MB, 1),
            "after_first_step_mb": round((warmed - base) / MB, 1),
            "fwd_bwd_peak_mb": round((marks["fwd_bwd"] - base) / MB, 1),
            "optimizer_step_peak_mb": round((marks["step"] - base) / MB, 1),
            "peak_mb": round((peak - base) / MB, 1), "seconds": round(seconds, 1)}


def _spawn(ckpt: str, warm_ckpt: str, tokens: int, ac: bool) -> dict:
    cmd = [sys.executable, __file__, "--case", ckpt, warm_ckpt, str(tokens), str(int(ac))]
    # glibc's malloc otherwise keeps freed tensors' pages (its mmap threshold grows after a free)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", default=["dev", "validation"], choices=sorted(CASES))
    p.add_argument("--out", default=str(ROOT / "bench/results/memory_model.json"))
    p.add_argument("--case", nargs=4, help=argparse.SUPPRESS)  # checkpoint warm-up-checkpoint tokens ac
    a = p.parse_args()
    if a.case:
        ckpt, warm, tokens, ac = a.case
        print(json.dumps(run_case(ckpt, warm, int(tokens), bool(int(ac)))))
        return
    rows = []
    for group in a.cases:
        for name, (hidden, layers, heads, kv, inter, vocab, tokens, ac) in CASES[group].items():
            with tempfile.TemporaryDirectory() as work:
                ckpt = _checkpoint(Path(work) / "ckpt", hidden, layers, heads, kv, inter, vocab, tokens)
                # the warm-up model: the case's head layout (GQA or not), tiny sizes
                warm = _checkpoint(Path(work) / "warm", 64, 2, 4, 4 if kv == heads else 2, 128, 1024, 64)
                pred = predict(ckpt, tokens, ac)
                meas = _spawn(ckpt, warm, tokens, ac)
            ratio = pred["peak_mb"] / meas["peak_mb"]
            row = {"case": name, "group": group, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv,
                   "intermediate": inter, "vocab": vocab, "tokens": tokens, "activation_checkpointing": ac,
                   "predicted": pred, "measured": meas, "ratio_predicted_over_measured": round(ratio, 3),
                   "within_20_percent": abs(ratio - 1) <= 0.2}
            rows.append(row)
            print(f"{group:10} {name:28} predicted {pred['peak_mb']:8.1f} MB ({pred['phase']}), measured "
                  f"{meas['peak_mb']:8.1f} MB (fwd/bwd {meas['fwd_bwd_peak_mb']}, step {meas['optimizer_step_peak_mb']}), "
                  f"ratio {ratio:.3f}", flush=True)
    validation = [r for r in rows if r["group"] == "validation"]
    result = {
        "what": "the memory model's predicted peak of one fsdp2 train step (hpc_rl/memory/model.py trainer) against "
                "the measured peak resident memory above the RSS before the backend is built (VmHWM reset through "
                "/proc/self/clear_refs before the step and again when the optimizer step begins), a fresh subprocess "
                "per case, one thread, CPU, fp32, one rank; the second step (the first creates AdamW's state)",
        "fitted": "nothing: no coefficient of the model comes from these measurements; the dev cases were run while "
                  "the formulas were written, the validation cases (other shapes) are the check",
        "history": FIRST_RUN,
        "goal": "|predicted / measured - 1| <= 0.2 for at least three shapes",
        "met": sum(r["within_20_percent"] for r in validation) >= 3,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "malloc": "MALLOC_MMAP_THRESHOLD_=131072 (each tensor over 128 KiB its own mapping)"},
        "rows": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", a.out, "| goal met:", result["met"])


if __name__ == "__main__":
    main()

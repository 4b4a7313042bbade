"""The trainer's memory at growing vocabularies and long sequences (issue 44): the no-grad
log-prob pass chunked (trainer.logprob_chunk_tokens) against whole logits, and a training step's
activations with and without activation checkpointing (trainer.activation_checkpointing).

Every case runs in a fresh subprocess (one thread) on the fsdp2 backend of this checkout, one
process, CPU. Memory is the process's resident set from /proc/self/status: writing 5 to
/proc/self/clear_refs resets the peak (VmHWM) to the current RSS right before the measured
call, so a case's peak is that call's alone, not the model load's; glibc's mmap threshold is
fixed (MALLOC_MMAP_THRESHOLD_) so freed tensors leave the resident set. torch's allocator gives
no peak figures on CPU.

- logprob: a random Llama (hidden 256, 2 layers), one sequence of --tokens tokens, vocabularies
  32k/64k/128k; `FSDP2Backend.logprobs` with the default chunks (sized by the vocabulary: 2^26
  logits each), chunks of 1024 tokens, and chunk 0 (whole [1, tokens, vocab] logits, then their
  float32 log-softmax). Recorded: the pass's peak RSS above the RSS before it.
- checkpointing: a random Llama (hidden 256, --ac-layers layers, vocabulary --ac-vocab, chunked
  log-probs, default chunks), a train step (forward, backward, AdamW) of one --tokens-token sequence. A first
  step of 16 tokens creates the optimizer state, so the baseline (RSS before the measured step)
  holds the model, its optimizer state and the freed gradients' pages; activation memory is the
  step's peak above that baseline (it includes the step's weight gradients, the same with and
  without).

    python bench/logprob_memory.py [--tokens 4096] [--ac-layers 8] [--vocabs 32768 65536 131072]
                                   [--out bench/results/logprob_memory.json]
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

VOCABS = (32768, 65536, 131072)
CHUNK = 1024
# the log-prob pass's settings of trainer.logprob_chunk_tokens (-1 on the command line: unset)
SETTINGS = {"chunked_default": -1, "chunked_1024": CHUNK, "whole": 0}


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _checkpoint(path: Path, vocab: int, layers: int, max_positions: int) -> str:
    """A random Llama saved with the tiny tokenizer (the backend's checkpoint check wants one;
    the ids here are random, so its vocabulary need not match)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_rl.models.tokenizer import build_tokenizer

    torch.manual_seed(0)
    build_tokenizer(path)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max_positions,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


def run_case(kind: str, vocab: int, layers: int, tokens: int, setting: int, workdir: str) -> dict:
    """One measurement, in this (fresh) process."""
    import torch

    from hpc_rl.models.fsdp2 import FSDP2Backend, OptimConfig

    torch.set_num_threads(1)
    ckpt = _checkpoint(Path(workdir) / "ckpt", vocab, layers, tokens + 8)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    attn = torch.ones_like(ids)
    if kind == "logprob":
        b = FSDP2Backend(ckpt, train=False, logprob_chunk_tokens=None if setting < 0 else setting,
                         logprob_batch_tokens=0)
        b.logprobs(ids[:, :16], attn[:, :16])  # first-call allocations (thread pools, caches) out of the figure
        call = lambda: b.logprobs(ids, attn)  # noqa: E731
    else:
        b = FSDP2Backend(ckpt, optim=OptimConfig(lr=1e-4), activation_checkpointing=bool(setting))
        loss = lambda lp, rows: (-lp.mean(), {})  # noqa: E731
        b.train_step(ids[:, :16], attn[:, :16], loss)  # creates AdamW's state: part of the baseline
        call = lambda: b.train_step(ids, attn, loss)  # noqa: E731
    base = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    call()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    return {"kind": kind, "vocab": vocab, "layers": layers, "tokens": tokens, "setting": setting,
            "baseline_rss_mb": round(base / 2**20, 1), "peak_rss_mb": round(peak / 2**20, 1),
            "above_baseline_mb": round((peak - base) / 2**20, 1), "seconds": round(seconds, 2)}


def _spawn(*args) -> dict:
    with tempfile.TemporaryDirectory() as work:
        cmd = [sys.executable, __file__, "--case", *map(str, args), work]
        # glibc's malloc otherwise keeps freed tensors' pages (its mmap threshold grows after a free)
        # and reuses them unseen by the RSS: with a fixed threshold every tensor over 128 KiB is its own
        # mapping, given back when freed, so the resident set follows the live tensors
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ac-layers", type=int, default=8)
    p.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    # small, so the step's weight gradients and AdamW's temporaries (in both figures) do not hide
    # the activations
    p.add_argument("--ac-vocab", type=int, default=8192)
    p.add_argument("--out", default=str(ROOT / "bench/results/logprob_memory.json"))
    p.add_argument("--case", nargs=6, help=argparse.SUPPRESS)  # kind vocab layers tokens setting workdir
    a = p.parse_args()
    if a.case:
        kind, vocab, layers, tokens, setting, work = a.case
        print(json.dumps(run_case(kind, int(vocab), int(layers), int(tokens), int(setting), work)))
        return
    logprob = []
    for vocab in a.vocabs:
        row = {"vocab": vocab}
        for name, chunk in SETTINGS.items():
            r = _spawn("logprob", vocab, 2, a.tokens, chunk)
            row[name] = r
            print(f"logprob vocab {vocab} {name}: +{r['above_baseline_mb']} MB ({r['seconds']} s)", flush=True)
        logprob.append(row)
    ac = {name: _spawn("train", a.ac_vocab, a.ac_layers, a.tokens, on) for name, on in (("off", 0), ("on", 1))}
    ratio = ac["off"]["above_baseline_mb"] / max(ac["on"]["above_baseline_mb"], 1e-9)
    print(f"activation checkpointing: +{ac['off']['above_baseline_mb']} MB off, +{ac['on']['above_baseline_mb']} MB on "
          f"({ratio:.2f}x)", flush=True)
    result = {
        "what": "peak resident memory above the RSS before the call (VmHWM reset through /proc/self/clear_refs), "
                "a fresh subprocess per case, one thread, CPU; torch's allocator has no CPU peak figures",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "malloc": "MALLOC_MMAP_THRESHOLD_=131072 (each tensor over 128 KiB its own mapping)"},
        "logprob_pass": {"model": "random Llama, hidden 256, 2 layers, intermediate 1024", "tokens": a.tokens,
                         "settings": {"chunked_default": "trainer.logprob_chunk_tokens unset: 2^26 logits per chunk "
                                                         "(2048 tokens at 32k, 512 at 128k)",
                                      "chunked_1024": "chunks of 1024 tokens", "whole": "0: whole logits"},
                         "rows": logprob,
                         "growth_32k_to_128k_mb": {
                             name: round(logprob[-1][name]["above_baseline_mb"] - logprob[0][name]["above_baseline_mb"], 1)
                             for name in SETTINGS}},
        "activation_checkpointing": {"model": f"random Llama, hidden 256, {a.ac_layers} layers, intermediate 1024, "
                                              f"vocab {a.ac_vocab}, default log-prob chunks",
                                     "tokens": a.tokens, "off": ac["off"], "on": ac["on"],
                                     "activation_ratio_off_over_on": round(ratio, 2)},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()

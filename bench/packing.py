"""Packed against padded train steps on a batch whose lengths are drawn like RL rollouts (issue 44).

One process, the fsdp2 backend on CPU (fp32), a random Llama-architecture model; the batch's
lengths are drawn from an exponential with mean a quarter of the maximum (clipped to
[min_len, max_len], one row at the maximum, as a batch's longest rollout usually is). Both
sides see the same rows and the same tokens per forward: padded, `rows_per_micro` rows of
the batch's width (today's trainer.micro_batch_size path); packed, micro-batches of at most
rows_per_micro x max_len tokens (trainer.packing, trainer.micro_batch_tokens). Each side runs
`repeats` train steps, alternating, after one warm-up step each; tokens/s counts real tokens.

    python bench/packing.py            # writes bench/results/packing.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hpc_rl.models.tokenizer import build_tokenizer
from hpc_rl.models.fsdp2 import FSDP2Backend


def rl_lengths(rows: int, max_len: int, min_len: int, seed: int) -> torch.Tensor:
    """Exponential draws scaled so the clipped batch's mean is a quarter of max_len (clipping
    the tail pulls a plain exponential's mean below it), row 0 at max_len."""
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(rows).exponential_(1.0, generator=g)
    scale = max_len / 4
    for _ in range(50):
        lengths = (x * scale).round().long().clamp(min_len, max_len)
        lengths[0] = max_len
        scale *= (max_len / 4) / float(lengths.float().mean())
    return lengths


def batch(rows: int, max_len: int, min_len: int, vocab: int, seed: int):
    lengths = rl_lengths(rows, max_len, min_len, seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(8, vocab, (rows, max_len), generator=g)
    attn = (torch.arange(max_len)[None] < lengths[:, None]).long()
    return ids * attn, attn, lengths


def loss_of(mask):
    def fn(lp, rows):
        m = mask[rows].float()
        return -(lp * m).sum() / mask.float().sum(), {}
    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--rows-per-micro", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/packing.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64, num_key_value_heads=a.hidden // 64,
                      max_position_embeddings=a.max_len, tie_word_embeddings=False)
    ckpt = str(Path(tempfile.mkdtemp()) / "llama")
    LlamaForCausalLM(cfg).save_pretrained(ckpt, safe_serialization=True)
    build_tokenizer(Path(ckpt))  # the checkpoint check wants one beside the weights (ids here are random)
    ids, attn, lengths = batch(a.rows, a.max_len, a.min_len, a.vocab, a.seed)
    real = int(attn.sum())
    budget = a.rows_per_micro * a.max_len
    sides = {"padded": FSDP2Backend(ckpt, precision="fp32", train=True),
             "packed": FSDP2Backend(ckpt, precision="fp32", train=True, packing=True, micro_batch_tokens=budget)}
    times = {k: [] for k in sides}
    last = {}
    for k, b in sides.items():  # warm-up step each
        b.train_step(ids, attn, loss_of(attn), micro_batch_size=a.rows_per_micro)
    for _ in range(a.repeats):
        for k, b in sides.items():
            t0 = time.perf_counter()
            last[k] = b.train_step(ids, attn, loss_of(attn), micro_batch_size=a.rows_per_micro)
            times[k].append(time.perf_counter() - t0)
    tps = {k: [real / t for t in v] for k, v in times.items()}
    speedup = statistics.median(tps["packed"]) / statistics.median(tps["padded"])
    res = {
        "bench": "packing", "what": "train steps (forward with log-probs, backward, AdamW) of one batch, padded rows "
                                    "vs packed rows, alternating, one process, fp32 on CPU",
        "machine": {"cpu_threads": a.threads, "platform": platform.platform(), "torch": torch.__version__},
        "model": {"family": "llama", "hidden": a.hidden, "layers": a.layers, "vocab": a.vocab,
                  "params": sum(p.numel() for p in sides["padded"].model.parameters())},
        "batch": {"rows": a.rows, "max_len": a.max_len, "mean_len": float(lengths.float().mean()),
                  "mean_over_max": float(lengths.float().mean()) / a.max_len, "real_tokens": real,
                  "length_draw": "exponential, scaled so the clipped mean is max_len/4; clipped to [min_len, max_len], row 0 "
                                 "at max_len",
                  "seed": a.seed},
        "padded": {"micro_batch_size": a.rows_per_micro, "seconds": times["padded"],
                   "tokens_per_s": tps["padded"], "padding_share": last["padded"]["padding_share"],
                   "micro_batches": last["padded"]["micro_batches"]},
        "packed": {"micro_batch_tokens": budget, "seconds": times["packed"], "tokens_per_s": tps["packed"],
                   "padding_share": last["packed"]["padding_share"], "micro_batches": last["packed"]["micro_batches"]},
        "loss": {"padded": last["padded"]["loss"], "packed": last["packed"]["loss"]},
        "speedup_median": speedup,
        "speedup_range": [min(tps["packed"]) / max(tps["padded"]), max(tps["packed"]) / min(tps["padded"])],
        "goal": ">= 1.8x tokens/s", "goal_met": speedup >= 1.8,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("batch", "speedup_median", "speedup_range", "goal_met")}, indent=1))


if __name__ == "__main__":
    main()

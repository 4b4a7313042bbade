"""The vLLM engine behind the `InferenceEngine` protocol: the refit-ready `VLLMGenerator`
(hpc_rl/refit/vllm_engine.py) run from an engine's first generator task. An engine of
tensor parallel > 1 starts its workers in that task, or across several tasks
(engines/spanning.py); each worker is a refit rank."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hpc_rl.refit.vllm_engine import SampleRow, VLLMGenerator, engine_options

from .base import EngineSpec, Sampling
from .spanning import EngineFollower

# vLLM on CPU reserves gpu_memory_utilization of NUMA node 0's memory for its KV cache; the
# GPU default (0.85) cannot be met there, so CPU engines take at most this share.
CPU_MEMORY_FRACTION_CAP = 0.2


class VLLMEngine:
    def __init__(self, generator: VLLMGenerator):
        self.vllm = generator

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> "VLLMEngine":
        g = spec.generator
        return cls(VLLMGenerator(spec.checkpoint, precision=g.precision, max_model_len=spec.max_model_len,
                                 seed=spec.seed, memory_fraction=_memory_fraction(spec), max_num_seqs=g.max_num_seqs,
                                 tensor_parallel=g.parallel.tp, span=spec.span, expert_parallel=g.parallel.ep > 1,
                                 options={**engine_options(g, spec.on_gpu), **(spec.lora or {})}))

    @staticmethod
    def follower(spec: EngineSpec, seat) -> "EngineFollower":
        """The workers a follower task hosts for its engine, built from the same arguments."""
        g = spec.generator
        return EngineFollower(seat, spec.span, spec.checkpoint, g.precision, spec.max_model_len, spec.seed,
                              _memory_fraction(spec), g.max_num_seqs, g.parallel.tp, g.parallel.ep > 1,
                              {**engine_options(g, spec.on_gpu), **(spec.lora or {})})

    @property
    def weight_version(self) -> int:
        return self.vllm.weight_version

    @property
    def tensor_parallel(self) -> int:
        return self.vllm.tensor_parallel

    @property
    def expert_parallel(self) -> bool:
        return self.vllm.expert_parallel

    @property
    def kv_cache_tokens(self) -> Tuple[int, int]:
        """(tokens the engine's KV cache holds, its block size), as vLLM sized it at start."""
        cc = self.vllm.llm.llm_engine.vllm_config.cache_config
        return int(cc.num_gpu_blocks or 0) * int(cc.block_size), int(cc.block_size)

    def sample(self, messages: Sequence[Any], sampling: Sampling, seeds: Sequence[int],
               between_steps: Optional[Callable[[], None]] = None) -> List[SampleRow]:
        tok = self.vllm.tokenizer
        prompts = [tok.apply_chat_template(_messages(m), tokenize=False, add_generation_prompt=True) for m in messages]
        return self.vllm.sample(prompts, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                max_tokens=sampling.max_tokens, stop=list(sampling.stop), seed=list(seeds),
                                min_tokens=sampling.min_tokens,
                                between_steps=between_steps)

    @property
    def tokenizer(self):
        return self.vllm.tokenizer

    def serve(self, requests, until: Callable[[], bool], between_steps: Optional[Callable[[], None]] = None):
        from hpc_rl.serving import serve

        return serve(self.vllm, requests, until, between_steps)

    def params(self) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        return self.vllm.params()

    def join_refit(self, setup: Any, first_rank: int, host: str, port: int) -> Dict[str, Any]:
        return self.vllm.join_refit(setup, first_rank, host, port)

    def refit(self, version: int, timeout_s: float) -> Dict[str, Any]:
        return self.vllm.refit(version, timeout_s)

    def load_adapter(self, store, prefix: str, refit_no: int, version: Optional[int], in_flight: bool = False,
                     recompute_kv: bool = False) -> Dict[str, Any]:
        """The adapter refit (trainer.lora.refit=adapter): wait for and load the student's adapter
        (version None: the initial one, refit 0); `in_flight` between scheduler steps, as refit_in_flight."""
        from hpc_rl.refit.adapter_refit import receive

        return receive(self.vllm, store, prefix, refit_no, version, in_flight, recompute_kv)

    def refit_in_flight(self, version: int, timeout_s: float, recompute_kv: bool) -> Dict[str, Any]:
        return self.vllm.refit_in_flight(version, timeout_s, recompute_kv)

    def auth_counts(self) -> List[Dict[str, Any]]:
        return self.vllm.auth_counts()

    def close(self) -> None:
        self.vllm.close()


def _memory_fraction(spec: EngineSpec) -> float:
    g = spec.generator
    return g.gpu_memory_utilization if spec.on_gpu else min(g.gpu_memory_utilization, CPU_MEMORY_FRACTION_CAP)


def _messages(prompt: Any) -> list:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

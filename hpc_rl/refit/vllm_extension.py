"""A vLLM worker extension that receives weights from the trainer into the live engine.

vLLM instantiates it inside each of its workers (`LLM(worker_extension_cls=...)`) and
the generator calls its methods through `llm.collective_rpc`. The worker joins a gloo
group of its own (trainer rank 0 + the engine's workers) over a TCPStore: vLLM's workers
already own the default process group, so a second init_process_group is not an option.
Received tensors load between vLLM's layerwise-reload hooks: on CPU a plain
`model.load_weights` after the first load corrupts the processed kernel tensors.
"""

from __future__ import annotations

from datetime import timedelta
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RefitWorkerExtension:
    """Methods become callable as llm.collective_rpc("hpc_rl_<name>", args=...)."""

    def hpc_rl_join(self, host: str, port: int, rank: int, world: int, prefix: str, timeout_s: float) -> int:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self._hpc_rl_pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world,
                                                timedelta(seconds=timeout_s))
        self._hpc_rl_version = -1
        return rank

    def hpc_rl_receive(self, meta: Sequence[Tuple[str, Sequence[int], str]], src: int, version: int) -> int:
        """Receive every tensor of `meta` (name, shape, dtype) broadcast from `src`, in order,
        and load them into the running model; returns the new weight version."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (finalize_layerwise_reload,
                                                                       initialize_layerwise_reload)

        model = self.model_runner.get_model()
        received: List[Tuple[str, torch.Tensor]] = []
        for name, shape, dtype in meta:
            t = torch.empty(tuple(shape), dtype=DTYPE_NAMES[dtype])
            self._hpc_rl_pg.broadcast(t, src).wait()
            received.append((name, t))
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
            model.load_weights(iter(received))
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        self._hpc_rl_version = version
        return version

    def hpc_rl_version(self) -> int:
        return getattr(self, "_hpc_rl_version", -1)

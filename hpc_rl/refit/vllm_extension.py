"""A vLLM worker extension that receives refit slices into the live engine.

vLLM instantiates it inside each of its workers (`LLM(worker_extension_cls=...)`) and
the generator calls its methods through `llm.collective_rpc`. The worker joins the refit
group over the job's TCPStore with a gloo (or NCCL) backend of its own: vLLM's workers
already own the default process group, so a second init_process_group is not an option.
From the group's `RefitSetup` it rebuilds the plan and prepares its walk once; at every
refit it streams the slices in and hands each finished tensor to vLLM while the next ones
are still arriving. On CPU the tensors load between vLLM's layerwise-reload hooks (a
plain `model.load_weights` after the first load corrupts the processed kernel tensors).
With tensor parallel > 1 every worker of the engine is its own rank of the refit group
and receives only its slices; they reach vLLM's loaders wrapped as `PreShardedWeight`
(refit/presharded.py), so the loaders' own narrowing and fused offsets still apply.
The weight version (the trainer step) is stamped only once every rank has passed the
end-of-refit barrier.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple


class RefitWorkerExtension:
    """Methods become callable as llm.collective_rpc("hpc_rl_<name>", args=...)."""

    def hpc_rl_params(self) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """The model's parameters as its weight loaders see them: name -> (local shape,
        dtype name). After loading, CPU kernels repack some parameters (empty shapes
        remain); vLLM records the loader-format shapes for reloading, and those count.
        Persistent buffers count too (vLLM's loader fills them by name like parameters): a
        tensor a checkpoint holds as a buffer, such as a router's e_score_correction_bias,
        must be checked and refitted wherever a model keeps it."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        model = self.model_runner.get_model()
        out = {n: (tuple(b.shape), str(b.dtype).split(".")[1]) for n, b in model.named_buffers()
               if b.is_floating_point()}
        out.update({n: (tuple(p.shape), str(p.dtype).split(".")[1]) for n, p in model.named_parameters()})
        for mod_name, module in model.named_modules():
            info = LAYERWISE_INFO.get(module)
            for p_name, meta in (info.restore_metadata[0].items() if info is not None else ()):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                out[full] = (tuple(meta.shape), str(meta.dtype).split(".")[1])
        return out

    def hpc_rl_join(self, setup, first_rank: int, host: str, port: int) -> Dict[str, float]:
        """Join the refit group as rank `first_rank` + this worker's tensor-parallel rank."""
        import torch.distributed as dist
        from datetime import timedelta

        from hpc_rl.refit.layout import Layout
        from hpc_rl.refit.session import RefitEndpoint, RefitSetup
        from hpc_rl.refit.transports import make_transport
        from vllm.distributed import get_tensor_model_parallel_rank

        t0 = time.perf_counter()
        setup = RefitSetup.from_wire(setup)
        pp = self.vllm_config.parallel_config.pipeline_parallel_size
        if pp > 1:  # the destination layouts describe tensor parallel only
            raise RuntimeError(f"refit into a vLLM engine with pipeline parallel {pp} is not supported; "
                               f"use tensor parallel (generator.parallel.pp=1)")
        rank = first_rank + get_tensor_model_parallel_rank()
        self._hpc_rl_shapes = {n: t.shape for n, t in Layout.from_dict(setup.dst).tensors.items()}
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=setup.timeout_s))
        on_gpu = next(self.model_runner.get_model().parameters()).is_cuda
        transport = make_transport(setup.transport, store, setup.prefix, rank, setup.world, setup.names,
                                   setup.timeout_s, cuda=on_gpu)
        self._hpc_rl_refit = RefitEndpoint(setup, rank, transport, device="cuda" if on_gpu else "cpu")
        self._hpc_rl_version = -1
        return {"rank": rank, "join_s": time.perf_counter() - t0, "prepare_s": self._hpc_rl_refit.prepare_s}

    def hpc_rl_refit(self, version: int, timeout_s: float, load: bool = True,
                     ready_key: Optional[str] = None) -> Dict[str, float]:
        """Receive this refit's slices and load them; returns timings and the new version.
        `load=False` only receives (the benchmark's transfer-only timing); `ready_key` is
        set in the store once the receives are posted (benchmarks start the senders on it,
        as they do for the raw reference)."""
        endpoint = self._hpc_rl_refit
        t0 = time.perf_counter()
        signal = (lambda: endpoint.transport.store.set(ready_key, "1")) if ready_key else None
        stream = endpoint.stream(timeout_s, on_posted=signal)
        phases = {"init_s": 0.0, "finalize_s": 0.0, "moe_layers_prepacked": 0}
        if load:
            phases = self._hpc_rl_load(self._hpc_rl_loader_weights(stream))
        else:
            for _ in stream:
                pass
        stats = endpoint.finish()
        if load:
            self._hpc_rl_version = version
        return {"version": self.hpc_rl_version(), "refit_s": time.perf_counter() - t0, "wait_s": stats.wait_s, "load_in_stream_s": stats.consumer_s,
                **phases, "stream_s": stats.seconds, "post_s": stats.post_s, "unpack_s": stats.unpack_s,
                "bytes": stats.bytes_received, "messages": stats.messages}

    def hpc_rl_auth_counts(self) -> Dict:
        """This worker process's authentication counts (runtime/auth_stats.py): it reads the
        refit group's keys through its own SignedStore."""
        from hpc_rl.runtime.auth_stats import process_counts

        return process_counts()

    def hpc_rl_load_local(self) -> Dict[str, float]:
        """Load the tensors of the last refit again from this worker's memory: what vLLM's
        weight processing alone costs (the benchmark's reference)."""
        pieces = [(rank, name, start, tensor) for rank, tensors in self._hpc_rl_refit.walk.holdings.dst.items()
                  for name, boxes in tensors.items() for start, tensor in boxes]
        t0 = time.perf_counter()
        self._hpc_rl_load(self._hpc_rl_loader_weights(iter(pieces)))
        return {"load_s": time.perf_counter() - t0}

    def _hpc_rl_loader_weights(self, pieces):
        """(HF name, tensor) as vLLM's loaders take them: whole tensors as they are, a
        tensor-parallel slice wrapped so that the loader's own narrow finds it. A tensor this
        worker keeps as several boxes (Nemotron-H's Mamba in_proj and conv1d: a box per part)
        goes to the loader once all its boxes arrived."""
        from hpc_rl.refit.presharded import as_loader_weight_of

        want = {(rank, name): len(boxes) for rank, tensors in self._hpc_rl_refit.walk.holdings.dst.items()
                for name, boxes in tensors.items()}
        waiting = {}
        for rank, name, start, tensor in pieces:
            boxes = waiting.setdefault((rank, name), [])
            boxes.append((start, tensor))
            if len(boxes) == want.get((rank, name), 1):
                del waiting[(rank, name)]
                yield name, as_loader_weight_of(boxes, self._hpc_rl_shapes[name], name)

    def _hpc_rl_load(self, weights) -> Dict[str, float]:
        """Load (HF name, tensor) pairs into the live model between vLLM's layerwise-reload
        hooks (CPU kernels repack weights; a bare load_weights would corrupt them)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (finalize_layerwise_reload,
                                                                       initialize_layerwise_reload)

        from hpc_rl.refit.vllm_moe_reload import prepack_reloaded_experts

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            t0 = time.perf_counter()
            initialize_layerwise_reload(model)
            t1 = time.perf_counter()
            model.load_weights(weights)
            t2 = time.perf_counter()
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            # MoE on CPU: what vLLM's reload skips (refit/vllm_moe_reload.py)
            prepacked = prepack_reloaded_experts(model)
        return {"init_s": t1 - t0, "finalize_s": time.perf_counter() - t2, "moe_layers_prepacked": prepacked}

    def hpc_rl_raw_receive(self, sizes: Dict[int, List[int]], timeout_s: float, ready_key: str) -> Dict[str, float]:
        """The benchmark's reference: from each peer, messages of `sizes[peer]` bytes (one flat
        message, or the walk's own message sizes) cut from one buffer, all posted at once, on
        the refit group's own transport."""
        import torch

        transport = self._hpc_rl_refit.transport
        # allocated once, like the refit's own buffers: page faults are not the transport's cost
        cache = getattr(self, "_hpc_rl_raw_bufs", {})
        msgs = []
        for p, ns in sizes.items():
            key = (int(p), tuple(int(n) for n in ns))
            if key not in cache:
                cache[key] = list(torch.split(torch.empty(sum(key[1]), dtype=torch.uint8), list(key[1])))
            msgs += [(key[0], b) for b in cache[key]]
        self._hpc_rl_raw_bufs = cache
        deadline = time.monotonic() + timeout_s
        t0 = time.perf_counter()
        handles = [(p, transport.recv(b, p, 0)) for p, b in msgs]
        transport.store.set(ready_key, "1")
        for p, h in handles:
            transport.wait(h, p, deadline, "receiving the raw reference message from")
        transport.barrier(deadline)
        return {"raw_s": time.perf_counter() - t0}

    def hpc_rl_mamba_state(self) -> Dict[str, dict]:
        """The Mamba-2 mixers' A, D and conv1d weight as this worker holds them, and whether
        vLLM's `conv_weights` buffer (a view of conv1d.weight that its CPU kernels read) still
        equals it after reloads (upstream vllm #42481: the alias broke on reload). Checks and
        tests compare these with a fresh load."""
        out = {}
        for name, module in self.model_runner.get_model().named_modules():
            if hasattr(module, "conv_weights") and hasattr(module, "A"):
                conv = module.conv1d.weight.detach()
                out[name] = {"A": module.A.detach().tolist(), "D": module.D.detach().tolist(),
                             "conv": conv.flatten().tolist(),
                             "alias_equal": bool((module.conv_weights == conv.view(conv.size(0), conv.size(2))).all())}
        return out

    def hpc_rl_tensors(self, suffix: str) -> Dict[str, list]:
        """Every parameter or buffer of this worker whose name ends with `suffix`, as a list
        (checks compare a refitted tensor with the trainer's, e.g. a router's bias)."""
        model = self.model_runner.get_model()
        found = dict(model.named_buffers())
        found.update(dict(model.named_parameters()))
        return {n: t.detach().cpu().tolist() for n, t in found.items() if n.endswith(suffix)}

    def hpc_rl_version(self) -> int:
        return getattr(self, "_hpc_rl_version", -1)

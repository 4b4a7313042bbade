"""TEST-ONLY shim that lets megatron-core 0.16.1 build and run its forward on CPU over gloo,
for tests/test_megatron_cpu_forward.py. Never imported by hpc_rl: the product path needs
CUDA and refuses CPU clusters (config/validate.py).

What it patches, in the process that calls install() (and nothing else):
  - torch.cuda.current_device() returns "cpu", so tensors megatron places "on the current
    device" land on the CPU;
  - torch.zeros/empty/ones/tensor/full/arange (and *_like) map a CUDA device argument to
    the CPU (the pipeline schedules and the optimizer allocate with device="cuda");
    torch.Tensor.cuda() returns the tensor itself;
  - megatron's model_parallel_cuda_manual_seed does nothing and its CUDA RNG tracker's
    fork() is a no-op context (dropout is 0 in hpc_rl's mapping, so no RNG stream matters).
Side effect seen here: Hugging Face models built after install() get wrong rotary buffers,
so tests compute Hugging Face references in a process without the shim.
Megatron's optimizer checks tensor types ('torch.cuda.FloatTensor'): training does not run
under this shim; the MoE alltoall dispatcher creates CUDA streams: MoE does not either.
"""

from __future__ import annotations

import contextlib

import torch

_DEVICE_FACTORIES = ("zeros", "empty", "ones", "tensor", "full", "arange", "zeros_like", "empty_like", "ones_like")


def _cpu(dev):
    if isinstance(dev, int) or (isinstance(dev, (str, torch.device)) and str(dev).startswith("cuda")):
        return "cpu"
    return dev


def install() -> None:
    torch.cuda.current_device = lambda: "cpu"
    for name in _DEVICE_FACTORIES:
        fn = getattr(torch, name)

        def wrapped(*a, _fn=fn, **k):
            if "device" in k:
                k["device"] = _cpu(k["device"])
            return _fn(*a, **k)

        setattr(torch, name, wrapped)
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    tensor_parallel.model_parallel_cuda_manual_seed = lambda *a, **k: None
    mrandom.model_parallel_cuda_manual_seed = lambda *a, **k: None
    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    mrandom.initialize_rng_tracker()

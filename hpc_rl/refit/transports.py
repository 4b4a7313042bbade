"""Which refit transport a group uses: the one place that knows every kind, above the
modules that implement them (transport.py: the torch point-to-point one and the protocol;
store_transports.py: NIXL and CUDA IPC, which build on transport.py's base)."""

from __future__ import annotations

from typing import Dict

import torch.distributed as dist

from .store_transports import CudaIpcTransport, NixlTransport
from .transport import TorchP2P


def make_transport(kind: str, store: dist.Store, prefix: str, rank: int, world: int, names: Dict[int, str],
                   timeout_s: float, cuda: bool = False):
    """The refit group's transport: "torch" (NCCL on GPUs, gloo on CPUs), "nixl", or
    "cuda_ipc" (every peer on the same GPU)."""
    if kind in ("nixl", "cuda_ipc"):  # transports that signal through the store (store_transports.py)
        return (NixlTransport if kind == "nixl" else CudaIpcTransport)(store, prefix, rank, world, names)
    if kind != "torch":
        raise ValueError(f"refit.transport={kind!r}: use torch, nixl or cuda_ipc")
    return (TorchP2P.nccl if cuda else TorchP2P.gloo)(store, prefix, rank, world, names, timeout_s)

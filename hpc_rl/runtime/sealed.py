"""Pickled objects between ranks, sealed with the job's MAC and checked before unpickling.

torch.distributed's object collectives (`send_object_list`, `all_gather_object`, ...)
unpickle whatever arrives on a gloo/NCCL connection, and pickle runs code. Here every
pickle travels as MAC || bytes (runtime/signed_store.py `seal`), the MAC keyed by the
job's secret and bound to the message's route and sequence number (sender, receiver or
group, n-th message on that route), so a message from a process outside the job, an
altered one, or one replayed from earlier on the route, is refused (`MessageRejected`)
before `pickle.loads` sees a byte. The sequence numbers count per process: every member
of a route calls it in the same order, as the collectives require anyway.

The tensors of the step (token rows inside the pickles included) are authenticated the
same way; refit weights travel on their own groups as raw tensors (never unpickled).
"""

from __future__ import annotations

import hashlib
import pickle
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .signed_store import OPS, job_key, seal, unseal

_seq: Counter = Counter()  # route -> messages sealed or opened on it so far (this process)
_group_ids: Dict[Any, str] = {}


class MessageRejected(RuntimeError):
    """A message without the job's valid MAC: not unpickled."""


def _next(route: str) -> str:
    n = _seq[route]
    _seq[route] += 1
    return f"{route}/{n}"


def _group_id(group: Optional[dist.ProcessGroup]) -> str:
    """A short name of the group's members (global ranks), the same on every member."""
    if group not in _group_ids:
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        _group_ids[group] = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    return _group_ids[group]


def dumps(obj: Any, label: str) -> bytes:
    blob = seal(job_key(), label, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    OPS["msg_seals"] += 1
    OPS["msg_sealed_bytes"] += len(blob)
    return blob


def loads(blob: bytes, label: str, sender: str) -> Any:
    OPS["msg_opens"] += 1
    OPS["msg_opened_bytes"] += len(blob)
    payload = unseal(job_key(), label, blob)
    if payload is None:
        raise MessageRejected(f"a message from {sender} ({label}) does not carry the job's MAC: refused before "
                              f"unpickling (sent by a process outside the job, altered on the way, or out of order)")
    return pickle.loads(payload)


def _device(group: Optional[dist.ProcessGroup]) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def send(obj: Any, dst: int) -> int:
    """`obj` to global rank `dst` (world group); returns the bytes sent."""
    data = dumps(obj, _next(f"p2p/{dist.get_rank()}->{dst}"))
    dist.send(torch.tensor([len(data)], dtype=torch.long), dst)
    dist.send(_bytes_tensor(data, torch.device("cpu")), dst)
    return len(data)


def recv(src: int) -> Tuple[Any, int]:
    """The next object from global rank `src`, and its size in bytes."""
    size = torch.zeros(1, dtype=torch.long)
    dist.recv(size, src)
    buf = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(buf, src)
    label = _next(f"p2p/{src}->{dist.get_rank()}")
    return loads(buf.numpy().tobytes(), label, f"rank {src}"), int(size)


def broadcast(obj: Any, src: int, group: Optional[dist.ProcessGroup]) -> Tuple[Any, int]:
    """`obj` of global rank `src` on every member of `group`; returns (obj, bytes)."""
    device = _device(group)
    label = _next(f"bcast/{_group_id(group)}/{src}")
    size = torch.zeros(1, dtype=torch.long, device=device)
    data = None
    if dist.get_rank() == src:
        data = dumps(obj, label)
        size[0] = len(data)
    dist.broadcast(size, src, group=group)
    n = int(size.item())
    buf = _bytes_tensor(data, device) if data is not None else torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src, group=group)
    if data is not None:
        return obj, n
    return loads(buf.cpu().numpy().tobytes(), label, f"rank {src}"), n


def all_gather(obj: Any, group: Optional[dist.ProcessGroup]) -> List[Any]:
    """Every member's `obj`, in group-rank order, on every member."""
    device = _device(group)
    world = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    route = f"gather/{_group_id(group)}"
    n = _seq[route]
    _seq[route] += 1
    data = dumps(obj, f"{route}/{n}/{dist.get_rank()}")
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.long, device=device), group=group)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[:len(data)] = _bytes_tensor(data, device)
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(bufs, mine, group=group)
    out = []
    for r, (buf, size) in enumerate(zip(bufs, sizes)):
        blob = buf[:int(size.item())].cpu().numpy().tobytes()
        out.append(loads(blob, f"{route}/{n}/{ranks[r]}", f"rank {ranks[r]}"))
    return out

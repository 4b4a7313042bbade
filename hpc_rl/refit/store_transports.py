"""The refit transports that signal through the job's store (refit/transport.py has the
interface, the shared failure naming and the readiness handshake).

`NixlTransport` moves registered buffers with NIXL agents over UCX (DRAM here, VRAM on
GPUs): receivers publish their buffers' descriptors in the store, senders WRITE into them.
`CudaIpcTransport` serves peers on one GPU (a colocated trainer and engine). Both end a
refit with a barrier through the store. Descriptors and IPC handles are unpickled only
after the SignedStore verified their MAC.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Dict, Tuple

import torch
import torch.distributed as dist

from hpc_rl.runtime.signed_store import signed

from .transport import _Named


class NixlTransport(_Named):
    """NIXL agents (UCX) writing registered buffers: DRAM here, VRAM on GPUs.

    A receive registers its buffer (once: refit buffers live across refits) and publishes
    its descriptors under a key both sides derive from the message's sequence number on
    that pair; the sender WRITEs into it with that key as the notification, and the
    receiver polls for the notification. Agents exchange metadata through the store."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world: int, names: Dict[int, str]):
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.store, self.prefix, self.rank, self.world, self.names = signed(store), prefix, rank, world, names
        self.agent = nixl_agent(f"{prefix}/{rank}", nixl_agent_config(backends=["UCX"]))
        self._remote: Dict[int, Tuple[str, int]] = {}  # peer -> (agent name, metadata version loaded)
        self._seq: Dict[tuple, int] = {}
        self._regs: Dict[tuple, object] = {}
        self._md_version = 0  # bumped by each new registration; peers reload our metadata then
        self._published = -1
        self.cuda = False

    def _load_peer(self, peer: int, version: int, deadline: float) -> str:
        """The peer's agent, with metadata at least as new as `version` (its registrations)."""
        name, loaded = self._remote.get(peer, (None, -1))
        if loaded < version:
            key = f"{self.prefix}/nixl/md/{peer}/{version}"
            self.store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            if name is not None:
                self.agent.remove_remote_agent(name)
            name = self.agent.add_remote_agent(self.store.get(key))
            name = name.decode() if isinstance(name, bytes) else name
            self._remote[peer] = (name, version)
        return name

    def _register(self, buf: torch.Tensor) -> None:
        key = (buf.data_ptr(), buf.numel() * buf.element_size())
        if key not in self._regs:
            self._regs[key] = self.agent.register_memory(buf)
            self._md_version += 1

    def _key(self, src: int, dst: int, tag: int) -> str:
        n = self._seq.get((src, dst, tag), 0)
        self._seq[(src, dst, tag)] = n + 1
        return f"{self.prefix}/nixl/{src}-{dst}/{tag}/{n}"

    def recv(self, buf: torch.Tensor, peer: int, tag: int):
        import pickle

        key = self._key(peer, self.rank, tag)
        self._register(buf)
        if self._published != self._md_version:
            self.store.set(f"{self.prefix}/nixl/md/{self.rank}/{self._md_version}", self.agent.get_agent_metadata())
            self._published = self._md_version
        descs = self.agent.get_serialized_descs(self.agent.get_xfer_descs(buf))
        self.store.set(key, pickle.dumps((self._md_version, descs)))
        return ("recv", key)

    def send(self, buf: torch.Tensor, peer: int, tag: int):
        return ("send", self._key(self.rank, peer, tag), buf)

    def wait(self, handle, peer: int, deadline: float, what: str) -> None:
        try:
            if handle[0] == "recv":
                note = handle[1].encode()
                while not self.agent.check_remote_xfer_done(f"{self.prefix}/{peer}", note):
                    if time.monotonic() > deadline:
                        raise TimeoutError("deadline passed")
                    time.sleep(0.0001)
                return
            import pickle

            key, buf = handle[1], handle[2]
            self.store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            version, descs = pickle.loads(self.store.get(key))  # verified: the MAC is checked before loads
            agent = self._load_peer(peer, version, deadline)
            self._register(buf)
            xfer = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(buf), self.agent.deserialize_descs(descs),
                                              agent, key.encode())
            try:
                state = self.agent.transfer(xfer)
                while state != "DONE":
                    if state == "ERR":
                        raise RuntimeError("NIXL transfer failed (connection closed)")
                    if time.monotonic() > deadline:
                        raise TimeoutError("deadline passed")
                    state = self.agent.check_xfer_state(xfer)
            finally:
                self.agent.release_xfer_handle(xfer)
        except Exception as exc:
            if "Disconnect" in type(exc).__name__ or "DISCONNECT" in str(exc):
                exc = RuntimeError(f"connection closed ({type(exc).__name__})")
            if isinstance(exc, dist.DistStoreError) or "Timeout" in type(exc).__name__:
                exc = TimeoutError("deadline passed")
            self._fail(peer, what, exc)

    def barrier(self, deadline: float) -> None:
        _store_barrier(self, deadline)


class CudaIpcTransport(_Named):
    """Peers on the same GPU (a colocated trainer and vLLM engine), where NCCL refuses two
    ranks of one communicator: the sender publishes a CUDA IPC handle of its buffer in the
    store, the receiver maps it and copies device to device, then acknowledges so the
    sender may reuse the buffer. Run on one H200 (tests/gpu/refit_check.sh, docs/refit.md)."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world: int, names: Dict[int, str]):
        self.store, self.prefix, self.rank, self.world, self.names = signed(store), prefix, rank, world, names
        self._seq: Dict[tuple, int] = {}
        self.cuda = True

    def _key(self, src: int, dst: int, tag: int) -> str:
        n = self._seq.get((src, dst, tag), 0)
        self._seq[(src, dst, tag)] = n + 1
        return f"{self.prefix}/ipc/{src}-{dst}/{tag}/{n}"

    # several buffers travel as one message (one store key of handles, one acknowledgement):
    # on one H200 a message costs about 0.5 ms of store round trips whatever its size, and a
    # 1.95 GB model sent slice by slice took 38-49 ms against 2 ms for one raw message
    # (bench/results/refit_gpu_b*_dmdefault.json)
    batches_direct = True

    def send(self, buf: torch.Tensor, peer: int, tag: int):
        return self.send_many([buf], peer, tag)

    def send_many(self, bufs, peer: int, tag: int):
        import pickle

        from torch.multiprocessing.reductions import reduce_tensor

        key = self._key(self.rank, peer, tag)
        torch.cuda.current_stream().synchronize()  # the bytes are in place before the peer reads them
        self.store.set(key, pickle.dumps([reduce_tensor(b) for b in bufs]))
        return ("send", key, bufs)

    def recv(self, buf: torch.Tensor, peer: int, tag: int):
        return self.recv_many([buf], peer, tag)

    def recv_many(self, bufs, peer: int, tag: int):
        return ("recv", self._key(peer, self.rank, tag), bufs)

    def wait(self, handle, peer: int, deadline: float, what: str) -> None:
        import pickle

        kind, key, bufs = handle
        try:
            left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            if kind == "recv":
                self.store.wait([key], left)
                handles = pickle.loads(self.store.get(key))  # verified: the MAC is checked before loads
                if len(handles) != len(bufs):
                    raise RuntimeError(f"{len(handles)} buffers arrived for {len(bufs)} expected")
                for buf, (rebuild, args) in zip(bufs, handles):
                    buf.copy_(rebuild(*args))
                torch.cuda.current_stream().synchronize()
                self.store.set(key + "/done", "1")
            else:
                self.store.wait([key + "/done"], left)
        except Exception as exc:
            if isinstance(exc, dist.DistStoreError) or "Timeout" in type(exc).__name__ or "timed out" in str(exc).lower():
                exc = TimeoutError("deadline passed")
            self._fail(peer, what, exc)

    def barrier(self, deadline: float) -> None:
        _store_barrier(self, deadline)


def _store_barrier(t: "_Named", deadline: float) -> None:
    """A barrier through the store (transports without collectives), naming who is missing.

    Rank 0 leaves last: every other rank's final store call is its departure count, and
    rank 0 returns only once all have departed. Rank 0 hosts the job's store (trainer rank
    0 in a run), and a host that left first would close the store under a rank still
    polling it ("Connection was likely closed", seen in a test where rank 0 then exits)."""
    t.epoch = getattr(t, "epoch", 0) + 1
    key = f"{t.prefix}/store_barrier/{t.epoch}"
    t._store_set(f"{t.prefix}/arrived/{t.epoch}/{t.rank}", "1")

    def wait_count(counter: str, what: str) -> None:
        while int(t.store.add(counter, 0)) < t.world:
            if time.monotonic() > deadline:
                t._fail(None, what, TimeoutError("deadline passed"), missing=t._not_arrived)
            time.sleep(0.0005)

    t.store.add(key, 1)
    wait_count(key, "in the end-of-refit barrier, waiting for")
    t.store.add(f"{key}/departed", 1)
    if t.rank == 0:
        wait_count(f"{key}/departed", "in the end-of-refit barrier, waiting for the departure of")

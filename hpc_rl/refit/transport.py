"""How refit bytes move between two processes: one small interface, real implementations.

`TorchP2P` posts point-to-point sends and receives on a torch.distributed backend object
(ProcessGroupGloo on CPUs, ProcessGroupNCCL on GPUs) built on the job's TCPStore; every
wait takes the time left before the refit's deadline. Gloo honours a wait timeout and
then closes the pair, so the peer's pending operations fail as well: a refit never hangs.

`NixlTransport` and `CudaIpcTransport` (store_transports.py) signal through the store:
NIXL agents over UCX (DRAM here, VRAM on GPUs; the second path, slower than gloo on this
machine) and CUDA IPC handles between peers on one GPU.

A failure names the peer (by role and rank, e.g. "generator:0") and, where one side gave
up first, says so through an abort key in the store so the other side reports the cause
rather than a bare "connection closed".

Every store value a transport writes or reads goes through the job's SignedStore
(runtime/signed_store.py): NIXL descriptors and CUDA IPC handles are unpickled only after
their MAC verified, so a value a stranger wrote under a refit key is never loaded. The
backends' own rendezvous (gloo/NCCL through `PrefixStore(prefix, store.raw)`) is C++ and
unsigned: docs/security.md.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from hpc_rl.runtime.signed_store import SignedStore, signed


class RefitError(RuntimeError):
    """A refit that could not finish: a peer died, hung past the deadline, or aborted."""


class Transport(Protocol):
    rank: int

    def send(self, buf: torch.Tensor, peer: int, tag: int): ...

    def recv(self, buf: torch.Tensor, peer: int, tag: int): ...

    def wait(self, handle, peer: int, deadline: float, what: str) -> None: ...

    def barrier(self, deadline: float) -> None: ...

    def ready(self, timeout_s: float) -> float: ...


def ready_key(prefix: str, refit_no: int, rank: int) -> str:
    """Refit rank `rank` is ready for the group's refit number `refit_no` (1, 2, ...): the
    one spelling of the key, for the endpoints and for the generator role's wait."""
    return f"{prefix}/ready/{refit_no}/{rank}"


def wait_ready(store: SignedStore, prefix: str, refit_no: int, ranks: Sequence[int], poll_s: float = 2.0,
               abort_key: Optional[str] = None) -> float:
    """Wait, with no deadline, until every rank in `ranks` is ready for refit `refit_no`;
    returns the seconds waited. A peer that is still training is healthy; one that died or
    froze is named by the heartbeats, one that is alive but stuck by the progress watchdog
    (runtime/heartbeat.py), and both end the process, so this wait cannot outlive them. A
    peer's abort (its refit failed first) or a lost store ends the wait with a RefitError."""
    t0 = time.monotonic()
    keys = [ready_key(prefix, refit_no, r) for r in ranks]
    while True:
        try:
            store.wait(keys, timedelta(seconds=poll_s))
            return time.monotonic() - t0
        except Exception as exc:  # this poll's timeout, or the store host (trainer:0) is gone
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise RefitError(f"lost the job's store (trainer:0) while waiting for the refit group to be ready: "
                                 f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
        reason = store.peek(abort_key) if abort_key is not None else None
        if reason is not None:
            raise RefitError(f"refit aborted by a peer: {reason.decode()}")


class _Named:
    """Names peers in errors and agrees on a culprit through the store (both transports)."""

    rank: int
    world: int
    names: Dict[int, str]
    store: Optional[SignedStore]
    prefix: str
    refit_no: int = 0  # the group's refits this rank has started (ready() counts them)
    timeout_s: float = 0.0  # refit.timeout_s of the current refit, for error messages

    def name(self, peer: int) -> str:
        return self.names.get(peer, f"refit rank {peer}")

    def ready(self, timeout_s: float) -> float:
        """Announce this rank ready for the group's next refit and wait (no deadline) until
        every rank is. The refit's deadline counts from here: a receiver that reached the
        refit while its senders still train does not spend its deadline on their train step.
        Returns the seconds waited for the others."""
        self.refit_no += 1
        self.timeout_s = timeout_s
        if self.store is None:  # no store (unit tests of the walk): nothing to agree on
            return 0.0
        self._doing(f"ready for refit {self.refit_no}")
        self._store_set(ready_key(self.prefix, self.refit_no, self.rank), "1")
        waited = wait_ready(self.store, self.prefix, self.refit_no, range(self.world),
                            abort_key=f"{self.prefix}/abort")
        self._doing(f"in refit {self.refit_no}")
        return waited

    def _doing(self, what: str) -> None:
        """What this rank is doing in the refit and since when (wall clock), for the error a
        late peer's receivers raise."""
        self._store_set(f"{self.prefix}/doing/{self.rank}", json.dumps({"what": what, "since": time.time()}))

    def _what_peer_does(self, peer: int) -> str:
        raw = self._store_get(f"{self.prefix}/doing/{peer}")
        if raw is None:
            return f"{self.name(peer)} has not reached this refit"
        d = json.loads(raw)
        return f"{self.name(peer)} was {d['what']} for {max(time.time() - d['since'], 0.0):.1f}s"

    def _deadline_note(self) -> str:
        all_ready = " from the moment every rank of the refit group was ready" if self.refit_no else ""
        return f"refit.timeout_s={self.timeout_s:g}{all_ready}" if self.timeout_s else "refit.timeout_s"

    def abort(self, reason: str) -> None:
        """Tell the other ranks why this refit stops (the first reason stays)."""
        if self.store is not None:
            try:
                self.store.compare_set(f"{self.prefix}/abort", "", reason)
            except Exception:  # the store may be gone with the job; the local error still raises
                pass

    def abort_reason(self) -> Optional[str]:
        return self._store_get(f"{self.prefix}/abort")

    def _fail(self, peer: Optional[int], what: str, exc: BaseException,
              missing: Optional[Callable[[], List[int]]] = None) -> None:
        """Raise a RefitError naming the culprit. Every failing rank records whom it waited
        for (timed out or lost); after a short grace every failing rank follows that chain (A
        waited on B, B on C, C on nobody: C is the one that did not arrive or died), so all
        sides name the same peer. A barrier waits on everyone: `missing` lists who had not
        arrived, and the culprit is where their chains end (a rank still failing its own
        wait is not the culprit: a CI run blamed a live sender whose peer had died)."""
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        timed_out = "timed out" in text.lower() or "deadline" in text or isinstance(exc, TimeoutError)
        if peer is not None:
            self._store_set(f"{self.prefix}/waiting/{self.rank}", str(peer))

        def ends() -> List[int]:
            return sorted({self._follow(r) for r in missing()}) if missing is not None else []

        grace = time.monotonic() + 1.0
        other = self.abort_reason()
        while other is None and time.monotonic() < grace:
            if missing is not None and len(ends()) == 1 and time.monotonic() > grace - 0.5:
                break  # the chains agree (after half the grace, so a slow rank can record)
            time.sleep(0.05)
            other = self.abort_reason()
        if other:
            raise RefitError(f"refit aborted by a peer: {other}") from exc
        if missing is not None:
            found = ends()
            peer = found[0] if found else None
        who = self.name(peer) if peer is not None else "a peer"
        culprit = self._follow(peer) if peer is not None else None
        late = culprit if culprit is not None else peer
        doing = f"; {self._what_peer_does(late)}" if late is not None else ""
        if culprit is not None and culprit != peer:
            reason = (f"{self.name(culprit)} did not arrive before the refit deadline ({self._deadline_note()}; "
                      f"{self.name(self.rank)} was {what} {who}, which waited on it{doing})")
        elif timed_out:
            reason = (f"{who} did not arrive before the refit deadline ({self._deadline_note()}; "
                      f"{self.name(self.rank)} was {what} it{doing})")
        elif "closed" in text.lower() or "reset" in text.lower():
            reason = f"lost {who} while {what} it (its connection closed: it died or aborted)"
        else:
            reason = f"{what} {who} failed: {text[:200]}"
        self.abort(f"{self.name(self.rank)}: {reason}")
        raise RefitError(reason) from exc

    def _not_arrived(self) -> List[int]:
        """Ranks that have not reached this epoch's end-of-refit barrier."""
        return [r for r in range(self.world)
                if self._store_get(f"{self.prefix}/arrived/{getattr(self, 'epoch', 0)}/{r}") is None]

    def _follow(self, peer: int) -> int:
        seen = {self.rank}
        while peer not in seen:
            seen.add(peer)
            nxt = self._store_get(f"{self.prefix}/waiting/{peer}")
            if nxt is None:
                return peer
            peer = int(nxt)
        return peer

    def _store_set(self, key: str, value: str) -> None:
        if self.store is not None:
            try:
                self.store.set(key, value)
            except Exception:
                pass

    def _store_get(self, key: str) -> Optional[str]:
        if self.store is None:
            return None
        try:
            value = self.store.peek(key)
            return value.decode() if value is not None else None
        except Exception:
            return None


class TorchP2P(_Named):
    """Sends and receives on a c10d backend (gloo or NCCL) of the refit group."""

    def __init__(self, backend, rank: int, world: int, names: Dict[int, str], store: Optional[dist.Store] = None,
                 prefix: str = "refit"):
        self.backend, self.rank, self.world, self.names = backend, rank, world, names
        self.store, self.prefix = (signed(store) if store is not None else None), prefix
        self.cuda = False

    @classmethod
    def gloo(cls, store: dist.Store, prefix: str, rank: int, world: int, names: Dict[int, str],
             timeout_s: float) -> "TorchP2P":
        store = signed(store)  # gloo's own keys go to the raw store (C++): docs/security.md
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store.raw), rank, world, timedelta(seconds=timeout_s))
        return cls(pg, rank, world, names, store, prefix)

    @classmethod
    def nccl(cls, store: dist.Store, prefix: str, rank: int, world: int, names: Dict[int, str],
             timeout_s: float) -> "TorchP2P":
        store = signed(store)
        pg = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store.raw), rank, world,
                                   dist.ProcessGroupNCCL.Options())
        out = cls(pg, rank, world, names, store, prefix)
        out.cuda = True
        return out

    def send(self, buf: torch.Tensor, peer: int, tag: int):
        return self.backend.send([buf], peer, tag)

    def recv(self, buf: torch.Tensor, peer: int, tag: int):
        return self.backend.recv([buf], peer, tag)

    def wait(self, handle, peer: int, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError("deadline passed")
            if self.cuda:
                handle.wait()
            else:
                handle.wait(timedelta(seconds=left))
        except Exception as exc:
            self._fail(peer, what, exc)

    def barrier(self, deadline: float) -> None:
        """Everyone arrived: one tiny all-reduce, so a sender knows its receivers finished.
        Arrivals are also noted in the store, so a timeout can name who is missing."""
        self.epoch = getattr(self, "epoch", 0) + 1
        self._store_set(f"{self.prefix}/arrived/{self.epoch}/{self.rank}", "1")
        t = torch.ones(1, device="cuda" if self.cuda else "cpu")
        work = self.backend.allreduce([t])
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError("deadline passed")
            work.wait(timedelta(seconds=left)) if not self.cuda else work.wait()
        except Exception as exc:
            self._fail(None, "in the end-of-refit barrier, waiting for", exc, missing=self._not_arrived)
        if int(t.item()) != self.world:
            raise RefitError(f"refit barrier counted {int(t.item())} of {self.world} ranks")

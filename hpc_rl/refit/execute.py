"""Walk a refit plan on one process: send the slices it owns, receive the slices it keeps.

Every process of the refit group runs the same walk over the same plan and acts only on
the transfers that touch it, so no message says what comes next. Per bucket and per peer
the small slices travel packed in one message (one copy each side; message overheads,
not bytes, dominate small tensors), and slices of at least `direct_min` bytes travel on
their own straight from and into the tensors when those are contiguous. A process may
play several layout ranks (a trainer shard and a vLLM shard on one GPU): transfers
between its own ranks are copies.

The walk is pipelined: later buckets' messages are posted before this bucket is waited
on (all of them by default: each message has its own buffer, prepared once), and `stream()` hands each destination piece to the caller as soon as its last
byte is in, so a receiver can load weights while later buckets are still arriving.
Stage-1 transfers (forwards inside a destination domain) are posted once the stage-0
bytes they forward have landed. Every wait is bounded by the refit's deadline.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from .layout import Layout
from .planner import Plan, Transfer
from .transport import RefitError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIGN = 16  # packed segments start on 16-byte boundaries so each can be viewed as its dtype
Start = Tuple[int, ...]


def box_view(tensor: torch.Tensor, start: Start, lo: Sequence[int], hi: Sequence[int]) -> torch.Tensor:
    """The part [lo, hi) of the global tensor, from a local tensor that holds the box at `start`."""
    return tensor[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))]


@dataclass
class Holdings:
    """The tensors one process holds, by layout rank and HF name, with the global start of
    the box each one covers. Sources are read; destinations are written."""

    # name -> (start, tensor), or a list of them when a rank holds a tensor in several boxes
    src: Dict[int, Dict[str, object]] = field(default_factory=dict)
    dst: Dict[int, Dict[str, List[Tuple[Start, torch.Tensor]]]] = field(default_factory=dict)

    @staticmethod
    def allocate(layout: Layout, ranks: Sequence[int], device: str = "cpu") -> Dict[int, Dict[str, List[Tuple[Start, torch.Tensor]]]]:
        """Empty destination tensors for the boxes `ranks` keep in `layout`."""
        out: Dict[int, Dict[str, List[Tuple[Start, torch.Tensor]]]] = {}
        for t in layout.tensors.values():
            for p in t.pieces:
                if p.rank in ranks:
                    shape = tuple(b - a for a, b in zip(p.start, p.stop))
                    out.setdefault(p.rank, {}).setdefault(t.name, []).append(
                        (p.start, torch.empty(shape, dtype=DTYPES[t.dtype], device=device)))
        return out


@dataclass
class _Seg:
    transfer: Transfer
    view: torch.Tensor  # the slice in this process's tensor (source view or destination view)
    piece: Optional[tuple] = None  # destination piece key it fills (receiving side)
    offset: int = 0  # byte offset inside a packed message


@dataclass
class _Msg:
    peer: int
    stage: int
    outgoing: bool
    segs: List[_Seg]
    packed: bool
    nbytes: int
    buf: Optional[torch.Tensor] = None  # the packed or staging buffer, reused across refits
    wire: Optional[torch.Tensor] = None  # what goes on the wire: buf, or the slice itself, as bytes
    order: int = 0  # plan position of its first slice: messages are posted and waited in plan order
    # a transport that sends several buffers as one message (transport.batches_direct): the
    # large slices to one peer in one bucket travel together, each from its own place (no copy)
    bufs: Optional[List[Optional[torch.Tensor]]] = None  # per seg: its staging buffer or None
    wires: Optional[List[torch.Tensor]] = None


@dataclass
class _Bucket:
    local: List[Tuple[int, _Seg, torch.Tensor]] = field(default_factory=list)  # (stage, dst seg, src view)
    msgs: List[_Msg] = field(default_factory=list)


@dataclass
class RefitStats:
    seconds: float = 0.0
    wait_s: float = 0.0  # blocked on the transport
    consumer_s: float = 0.0  # inside the caller's hands between yields (e.g. vLLM loading)
    post_s: float = 0.0  # posting (and packing) messages
    unpack_s: float = 0.0  # copying packed or staged bytes into place
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    local_copies: int = 0


class RefitWalk:
    """One process's part of a plan, prepared once and run at every refit."""

    def __init__(self, plan: Plan, holdings: Holdings, proc_of: Mapping[int, int], me: int, transport,
                 direct_min: int = 1 << 20, ahead: Optional[int] = None):
        self.plan, self.holdings, self.me, self.transport = plan, holdings, me, transport
        self.proc_of = dict(proc_of)
        self.direct_min = direct_min
        # Buckets posted beyond the one being waited on. Every message has its own buffer
        # (prepared once), so by default all are posted at once: posting while a transport
        # thread streams a large message in contends for the same connection lock.
        self.ahead = ahead
        self.pieces: Dict[tuple, int] = {}  # (dst rank, name, index) -> bytes it needs from the walk
        self.buckets: List[_Bucket] = [self._prepare(b) for b in plan.buckets]
        self.stats = RefitStats()

    # --------------------------------------------------------------------------- preparation
    def _src_view(self, t: Transfer) -> torch.Tensor:
        if t.stage == 0:
            held = self.holdings.src[t.src][t.name]
            # one box, or several boxes of one tensor (a Megatron rank's Mamba in_proj holds
            # its piece of each of z, x, B, C, dt: models/megatron/nemotron_h_refit.py)
            for start, tensor in held if isinstance(held, list) else [held]:
                stop = tuple(s + n for s, n in zip(start, tensor.shape))
                if all(s <= a and b <= e for s, a, b, e in zip(start, t.start, t.stop, stop)):
                    return box_view(tensor, start, t.start, t.stop)
            raise RefitError(f"{t.name}: rank {t.src} holds no source box containing {t.start}..{t.stop}; the "
                             "plan and the source tensors disagree")
        return self._dst_view(t.src, t)[1]  # a forward reads what its landing rank received

    def _dst_view(self, rank: int, t: Transfer) -> Tuple[tuple, torch.Tensor]:
        for i, (start, tensor) in enumerate(self.holdings.dst[rank][t.name]):
            stop = tuple(s + n for s, n in zip(start, tensor.shape))
            if all(s <= a and b <= e for s, a, b, e in zip(start, t.start, t.stop, stop)):
                return (rank, t.name, i), box_view(tensor, start, t.start, t.stop)
        raise RefitError(f"{t.name}: rank {rank} keeps no box containing {t.start}..{t.stop}; the plan and "
                         f"the destination tensors disagree")

    def _prepare(self, transfers: List[Transfer]) -> _Bucket:
        bucket = _Bucket()
        groups: Dict[Tuple[int, int, bool], List[_Seg]] = defaultdict(list)
        position = {id(t): i for i, t in enumerate(transfers)}
        for t in transfers:
            a, b = self.proc_of[t.src], self.proc_of[t.dst]
            if b == self.me:
                key, view = self._dst_view(t.dst, t)
                self.pieces[key] = self.pieces.get(key, 0) + t.nbytes
            if a == self.me and b == self.me:
                bucket.local.append((t.stage, _Seg(t, view, key), self._src_view(t)))
            elif a == self.me:
                groups[(b, t.stage, True)].append(_Seg(t, self._src_view(t)))
            elif b == self.me:
                groups[(a, t.stage, False)].append(_Seg(t, view, key))
        for (peer, stage, outgoing), segs in groups.items():  # insertion order = plan order on both sides
            small = [s for s in segs if s.transfer.nbytes < self.direct_min]
            if small:
                off = 0
                for s in small:
                    s.offset = off
                    off += -(-s.transfer.nbytes // ALIGN) * ALIGN
                buf = torch.empty(off, dtype=torch.uint8, device=small[0].view.device)
                bucket.msgs.append(_Msg(peer, stage, outgoing, small, True, off, buf, buf, position[id(small[0].transfer)]))
            direct = []
            for s in segs:
                if s.transfer.nbytes >= self.direct_min:
                    staging = None if s.view.is_contiguous() else torch.empty_like(s.view, memory_format=torch.contiguous_format)
                    wire = _as_bytes(staging if staging is not None else s.view)
                    direct.append(_Msg(peer, stage, outgoing, [s], False, s.transfer.nbytes, staging, wire,
                                       position[id(s.transfer)]))
            if len(direct) > 1 and getattr(self.transport, "batches_direct", False):
                # one message of several buffers: a message's fixed cost (CUDA IPC: handles through
                # the store, about 0.5 ms) is paid once per peer and bucket, not per slice
                direct = [_Msg(peer, stage, outgoing, [m.segs[0] for m in direct], False, sum(m.nbytes for m in direct),
                               order=direct[0].order, bufs=[m.buf for m in direct], wires=[m.wire for m in direct])]
            bucket.msgs.extend(direct)
        # Plan order across peers (each peer's own order is kept, which is what pairs a send
        # with its receive): a receiver waits tensor by tensor, not peer by peer, so the
        # first tensors are whole, and handed on, while the rest are still in flight.
        bucket.msgs.sort(key=lambda m: m.order)
        return bucket

    # ----------------------------------------------------------------------------------- run
    def _post(self, bucket: _Bucket, stage: int) -> List[Tuple[_Msg, object]]:
        t0 = time.perf_counter()
        try:
            return self._post_inner(bucket, stage)
        finally:
            self.stats.post_s += time.perf_counter() - t0

    def _post_inner(self, bucket: _Bucket, stage: int) -> List[Tuple[_Msg, object]]:
        for st, seg, src in bucket.local:
            if st == stage:
                seg.view.copy_(src)
                self.stats.local_copies += 1
        posted = []
        for m in bucket.msgs:
            if m.stage != stage:
                continue
            if m.outgoing:
                if m.packed:
                    for s in m.segs:
                        _segment(m.buf, s).copy_(s.view)
                elif m.wires is not None:
                    for s, staging in zip(m.segs, m.bufs):
                        if staging is not None:
                            staging.copy_(s.view)
                elif m.buf is not None:
                    m.buf.copy_(m.segs[0].view)
                posted.append((m, self.transport.send_many(m.wires, m.peer, stage) if m.wires is not None
                               else self.transport.send(m.wire, m.peer, stage)))
                self.stats.bytes_sent += m.nbytes
            else:
                posted.append((m, self.transport.recv_many(m.wires, m.peer, stage) if m.wires is not None
                               else self.transport.recv(m.wire, m.peer, stage)))
                self.stats.bytes_received += m.nbytes
            self.stats.messages += 1
        return posted

    def _finish(self, posted: List[Tuple[_Msg, object]], deadline: float, left: Dict[tuple, int],
                done: List[tuple]) -> Iterator[None]:
        """Wait for the posted messages in order; after each one that completes destination
        pieces, yield (the caller hands `done` on before the next wait)."""
        for m, handle in posted:
            t0 = time.perf_counter()
            self.transport.wait(handle, m.peer, deadline, _WaitWhat(m))
            t1 = time.perf_counter()
            self.stats.wait_s += t1 - t0
            if m.outgoing:
                continue
            for i, s in enumerate(m.segs):
                if m.packed:
                    s.view.copy_(_segment(m.buf, s))
                elif m.wires is not None:
                    if m.bufs[i] is not None:
                        s.view.copy_(m.bufs[i])
                elif m.buf is not None:
                    s.view.copy_(m.buf)
                _count(left, s, done)
            self.stats.unpack_s += time.perf_counter() - t1
            if done:
                yield

    def stream(self, deadline: float, on_posted=None) -> Iterator[Tuple[int, str, Start, torch.Tensor]]:
        """Run the walk; yields (dst rank, name, box start, tensor) for each destination piece
        of this process as soon as it is whole. Raises RefitError on a dead or late peer.
        `on_posted` is called once the first buckets' messages are posted."""
        t_start = time.perf_counter()
        self.stats = RefitStats()
        left = dict(self.pieces)
        posted: Dict[int, List[Tuple[_Msg, object]]] = {}
        ahead = len(self.buckets) if self.ahead is None else self.ahead
        done: List[tuple] = []

        def hand_on():
            for key in done:
                rank, name, i = key
                start, tensor = self.holdings.dst[rank][name][i]
                t0 = time.perf_counter()
                yield rank, name, start, tensor
                self.stats.consumer_s += time.perf_counter() - t0
            done.clear()

        for k, bucket in enumerate(self.buckets):
            for j in range(k, min(k + 1 + ahead, len(self.buckets))):
                if j not in posted:
                    posted[j] = self._post(self.buckets[j], 0)
            if k == 0 and on_posted is not None:
                on_posted()
            for st, seg, _ in bucket.local:  # this bucket's local stage-0 copies were made when it was posted
                if st == 0:
                    _count(left, seg, done)
            yield from hand_on()
            for _ in self._finish(posted.pop(k), deadline, left, done):
                yield from hand_on()
            forwards = self._post(bucket, 1)
            for st, seg, _ in bucket.local:
                if st == 1:
                    _count(left, seg, done)
            yield from hand_on()
            for _ in self._finish(forwards, deadline, left, done):
                yield from hand_on()
        missing = [k for k, v in left.items() if v]
        if missing:
            raise RefitError(f"refit plan left {len(missing)} destination pieces incomplete, e.g. {missing[0]}")
        self.stats.seconds = time.perf_counter() - t_start

    def run(self, deadline: float) -> RefitStats:
        """Walk without consuming (senders; receivers that only need the bytes in place)."""
        for _ in self.stream(deadline):
            pass
        return self.stats


class _WaitWhat:
    """What a message is, for a timeout's message; built only if one is raised."""

    def __init__(self, m: _Msg):
        self.m = m

    def __str__(self) -> str:
        m = self.m
        return (f"{'sending' if m.outgoing else 'receiving'} {m.segs[0].transfer.name} (stage {m.stage}) "
                f"{'to' if m.outgoing else 'from'}")


def _count(left: Dict[tuple, int], seg: _Seg, done: List[tuple]) -> None:
    left[seg.piece] -= seg.transfer.nbytes
    if left[seg.piece] == 0:
        done.append(seg.piece)


def _segment(buf: torch.Tensor, s: _Seg) -> torch.Tensor:
    n = s.transfer.nbytes
    return buf[s.offset:s.offset + n].view(s.view.dtype).view(s.view.shape)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t

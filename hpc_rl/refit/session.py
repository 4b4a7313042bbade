"""One refit group, as each of its processes sees it.

`RefitSetup` is plain data (layouts as dicts, the domain map, which process plays which
layout rank, names for error messages): the trainer builds it once and every member of
the group, vLLM workers included, rebuilds the same plan from it, so the plan itself never
travels. `RefitEndpoint` is one process's prepared part: its source tensors, its
destination buffers (allocated once, reused at every refit), the walk, and the deadline.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple

import torch

from .execute import Holdings, RefitStats, RefitWalk, Start
from .layout import Layout
from .planner import Plan, plan_refit


@dataclass
class RefitSetup:
    src: dict  # Layout.to_dict() of the trainer side
    dst: dict  # ... of the vLLM side
    proc_of: Dict[int, int]  # layout rank -> rank in the refit group
    names: Dict[int, str]  # refit-group rank -> "trainer:0", "generator:1" (for errors)
    prefix: str  # the group's namespace in the job's TCPStore
    domain_of: Optional[Dict[int, str]] = None  # layout rank -> NVLink domain, when known
    bucket_bytes: int = 64 << 20
    direct_min: int = 64 << 10  # slices from 64 KiB travel on their own, zero-copy where contiguous
    timeout_s: float = 120.0
    transport: str = "torch"  # "torch" (NCCL on GPUs, gloo on CPUs) or "nixl"

    def to_wire(self) -> dict:
        """Plain dict for RPC layers that do not carry dataclasses (vLLM's collective_rpc)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: Mapping) -> "RefitSetup":
        d = dict(d)
        for key in ("proc_of", "names", "domain_of"):
            if d.get(key) is not None:
                d[key] = {int(k): v for k, v in d[key].items()}
        return cls(**d)

    @property
    def world(self) -> int:
        return max(self.proc_of.values()) + 1

    def plan(self) -> Plan:
        return plan_refit(Layout.from_dict(self.src), Layout.from_dict(self.dst), self.domain_of, self.bucket_bytes)

    def layout_ranks(self, proc: int):
        return [r for r, p in self.proc_of.items() if p == proc]


@dataclass
class RefitEndpoint:
    setup: RefitSetup
    me: int
    transport: object
    sources: Dict[int, Dict[str, Tuple[Start, torch.Tensor]]] = field(default_factory=dict)
    device: str = "cpu"

    def __post_init__(self):
        t0 = time.perf_counter()
        self.plan = self.setup.plan()
        dst = Holdings.allocate(Layout.from_dict(self.setup.dst), self.setup.layout_ranks(self.me), self.device)
        self.walk = RefitWalk(self.plan, Holdings(src=self.sources, dst=dst), self.setup.proc_of, self.me,
                              self.transport, self.setup.direct_min)
        self.prepare_s = time.perf_counter() - t0
        self.deadline = 0.0
        self.ready_wait_s = 0.0  # the last refit's wait for the group to be ready

    def set_sources(self, sources: Dict[int, Dict[str, Tuple[Start, torch.Tensor]]]) -> None:
        """New source tensors for the next refit. Only when they are other tensors than the
        prepared ones (a cast copy, a reloaded model) is the walk prepared again."""
        def ptrs(s):
            return {(r, n): tuple(t.data_ptr() for _, t in (b if isinstance(b, list) else [b]))
                    for r, d in s.items() for n, b in d.items()}

        if ptrs(sources) != ptrs(self.sources):
            self.sources = sources
            self.walk = RefitWalk(self.plan, Holdings(src=sources, dst=self.walk.holdings.dst), self.setup.proc_of,
                                  self.me, self.transport, self.setup.direct_min)

    def stream(self, timeout_s: Optional[float] = None, on_posted=None,
               on_ready: Optional[Callable[[], None]] = None) -> Iterator[Tuple[int, str, Start, torch.Tensor]]:
        """Wait until every rank of the group is ready (no deadline: runtime/heartbeat.py
        watches for dead and stuck peers), then stream this rank's part within `timeout_s`.
        `on_ready` runs once all are ready (a role leaves its waiting phase there)."""
        timeout_s = timeout_s or self.setup.timeout_s
        self.ready_wait_s = self.transport.ready(timeout_s)
        if on_ready is not None:
            on_ready()
        self.deadline = time.monotonic() + timeout_s
        return self.walk.stream(self.deadline, on_posted)

    def finish(self) -> RefitStats:
        """The end-of-refit barrier (within the same deadline): every side knows all arrived."""
        self.transport._doing(f"in the end-of-refit barrier of refit {self.transport.refit_no}")
        self.transport.barrier(self.deadline)
        self.transport._doing(f"done with refit {self.transport.refit_no}")
        return self.walk.stats

    def run(self, timeout_s: Optional[float] = None, on_ready: Optional[Callable[[], None]] = None) -> RefitStats:
        for _ in self.stream(timeout_s, on_ready=on_ready):
            pass
        return self.finish()


def whole_tensor_sources(state: Mapping[str, torch.Tensor], rank: int) -> Dict[int, Dict[str, Tuple[Start, torch.Tensor]]]:
    """Sources for a process that holds whole tensors (an unsharded trainer)."""
    return {rank: {k: (tuple(0 for _ in v.shape), v.detach().contiguous()) for k, v in state.items()}}

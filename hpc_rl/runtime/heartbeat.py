"""Dead-rank detection through the rendezvous store: no rank sits hung on a collective.

Every rank runs a daemon thread with its own store connection that, each
`ft.heartbeat_interval_s`, bumps its counter `hb/<restart>/<rank>` and publishes what it
is doing (step and phase). Trainer rank 0, which hosts the store, also watches: a rank
whose counter has not moved for `ft.heartbeat_timeout_s` (killed, frozen, node gone) is
declared dead. The watcher judges by its own clock when it last saw each counter move,
so clock skew between nodes does not matter. It writes the verdict to `hb/<restart>/abort`
and `errors/dead_rank.<restart>.txt`; every rank's thread polls that key and, when set,
exits the process at once (`os._exit`): gloo and NCCL collectives cannot be interrupted
from Python, so ending the process is the only way to abort them. Losing the store
(trainer rank 0 itself died) is treated the same way, naming trainer:0. So is a store that
stops answering without closing (trainer rank 0 frozen, SIGSTOP or a hung node): a
TCPStore call then blocks with no timeout, so a second thread watches the beats and
aborts when none succeeded for `ft.heartbeat_timeout_s`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, Optional

import torch.distributed as dist

from hpc_rl.ft.culprit import STOPPED_BY_PEER_EXIT as ABORT_EXIT_CODE  # a peer died; this rank stopped on purpose
from hpc_rl.observe.timing import is_waiting, parse_status
from hpc_rl.rundir import RunDir

from .signed_store import SignedStore


def dead_rank_report(run_dir: Path, restart: int) -> Path:
    return RunDir(run_dir).dead_rank(restart)


class Heartbeat:
    def __init__(self, addr: str, port: int, rank: int, world: int, restart: int, describe: Callable[[int], str],
                 run_dir: Path, interval_s: float, timeout_s: float, log=None, exit_fn: Callable[[int], None] = os._exit,
                 progress_timeout_s: float = 0.0):
        self.addr, self.port, self.rank, self.world, self.restart = addr, port, rank, world, restart
        self.describe, self.run_dir = describe, Path(run_dir)
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.progress_timeout_s = progress_timeout_s
        self.log = log
        self.exit_fn = exit_fn
        self.status = "start"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.detected: Optional[str] = None  # the verdict, when this rank saw one
        self._last_beat = time.monotonic()  # when this rank's last beat reached the store

    def key(self, rank) -> str:
        return f"hb/{self.restart}/{rank}"

    def set_status(self, status: str) -> None:
        self.status = status  # read by the thread at its next beat

    def census(self, store: SignedStore, wait_s: Optional[float] = None) -> list:
        """Ranks whose heartbeat stopped: counters that did not move over two beats. Called
        when this rank's program failed, to tell a dead peer from the peers that merely lost
        it ('connection closed' everywhere). Returns [(rank, status)]."""
        wait_s = 2 * self.interval_s + 0.5 if wait_s is None else wait_s
        others = [r for r in range(self.world) if r != self.rank]
        before = {r: store.add(self.key(r), 0) for r in others}
        time.sleep(wait_s)
        dead = []
        for r in others:
            if store.add(self.key(r), 0) == before[r]:
                skey = self.key(f"{r}/status")
                status = (store.peek(skey) or b"?").decode()
                if status != "done":
                    dead.append((r, status))
        return dead

    def report_dead_peers(self, store, error: str) -> Optional[str]:
        """After a failure here: name the peers that stopped beating, in the dead-rank report
        the batch shell reads. Returns the verdict, or None when every peer still beats."""
        try:
            dead = self.census(store)
        except Exception:
            return None  # the store is gone too: nothing to learn from it
        if not dead:
            return None
        verdict = "; ".join(f"{self.describe(r)} stopped beating (killed or hung; last seen in {st})" for r, st in dead)
        verdict += f"; {self.describe(self.rank)} then failed ({error.split(':', 1)[0]})"
        report = dead_rank_report(self.run_dir, self.restart)
        if not report.exists():
            report.parent.mkdir(parents=True, exist_ok=True)
            report.write_text(verdict + "\n")
        return verdict

    def finish(self) -> None:
        """The program is done: from now on this rank's silence is not a death (call it
        before the final barrier, so no peer can see this rank go quiet first)."""
        self.status = "done"
        self._stop.set()

    def start(self) -> "Heartbeat":
        self._last_beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="hpc_rl-heartbeat", daemon=True)
        self._thread.start()
        if self.rank != 0:  # rank 0 hosts the store: its own calls cannot hang on a frozen host
            threading.Thread(target=self._watch_store, name="hpc_rl-heartbeat-store-watch", daemon=True).start()
        return self

    def _watch_store(self) -> None:
        """The store host frozen: its socket stays open and a beat blocks for ever. No beat
        for ft.heartbeat_timeout_s ends this rank, naming trainer:0."""
        while not self._stop.wait(self.interval_s):
            silent = time.monotonic() - self._last_beat
            if silent > self.timeout_s and self.status != "done" and self.detected is None:
                self._abort(f"trainer:0 (the rendezvous store host) stopped answering for {silent:.1f}s "
                            f"(ft.heartbeat_timeout_s={self.timeout_s:g}: frozen, or its node hung)", None)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1)

    def _run(self) -> None:
        try:
            store = SignedStore.from_env(dist.TCPStore(self.addr, self.port, is_master=False,
                                                       timeout=timedelta(seconds=max(self.timeout_s, 5)),
                                                       wait_for_workers=False))
        except Exception as exc:  # cannot even connect: the host is gone
            self._abort(f"trainer:0 (the rendezvous store host) unreachable: {exc}", None)
            return
        last_seen: Dict[int, tuple] = {}  # rank -> (counter, local time it last moved)
        progress: Dict[str, object] = {}  # the watcher's memory of everyone's phases
        abort_key = f"hb/{self.restart}/abort"
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                store.add(self.key(self.rank), 1)
                store.set(self.key(f"{self.rank}/status"), self.status)
                self._last_beat = time.monotonic()
                verdict = store.peek(abort_key)  # a forged verdict does not verify: ignored, counted
                if verdict is not None:
                    self._abort(verdict.decode(), None)
                    return
                if self.rank == 0 and self.progress_timeout_s > 0:
                    verdict = self._progress_check(store, now, progress)
                    if verdict:
                        self._publish(store, abort_key, verdict)
                        self._abort(verdict, store)
                        return
                if self.rank == 0:
                    for r in range(self.world):
                        if r == 0:
                            continue
                        count = store.add(self.key(r), 0)
                        prev = last_seen.get(r)
                        if prev is None or count != prev[0]:
                            last_seen[r] = (count, now)
                        elif now - prev[1] > self.timeout_s:
                            status = (store.peek(self.key(f"{r}/status")) or b"?").decode()
                            if status == "done":  # finished its program: silence is expected
                                continue
                            verdict = (f"{self.describe(r)} missed heartbeats for {now - prev[1]:.1f}s "
                                       f"(ft.heartbeat_timeout_s={self.timeout_s:g}); last seen in {status}")
                            self._publish(store, abort_key, verdict)
                            self._abort(verdict, store)
                            return
            except Exception as exc:  # the store (trainer rank 0's process) is gone
                if self._stop.is_set() or self.status == "done":
                    return
                self._abort(f"trainer:0 (the rendezvous store host) stopped answering: {exc}", None)
                return
            self._stop.wait(self.interval_s)
        try:  # tell the watcher this rank finished on purpose
            store.set(self.key(f"{self.rank}/status"), self.status)
        except Exception:
            pass

    def _progress_check(self, store, now: float, memo: Dict[str, object]) -> Optional[str]:
        """Alive but stuck: no rank's phase changed for progress_timeout_s. Names the ranks at
        work in the earliest phase: the waiting ones (phases "wait...", observe/timing.py) wait
        for them. When every rank waits (a lost message), names the earliest."""
        statuses = {}
        for r in range(self.world):
            k = self.key(f"{r}/status")
            statuses[r] = self.status if r == self.rank else (store.peek(k) or b"start").decode()
        parsed = {r: parse_status(v) for r, v in statuses.items()}
        in_steps = all(step is not None or is_waiting(phase) for step, phase in parsed.values())
        if not in_steps or all(step is None for step, _ in parsed.values()):
            # start-up (loading models, engines), evaluations and the end are not watched: only
            # steps, where a serving rank may still wait for its first step's work
            memo.clear()
            return None
        snapshot = tuple(sorted(statuses.items()))
        if memo.get("snapshot") != snapshot:
            memo["snapshot"], memo["since"] = snapshot, now
            return None
        stalled = now - float(memo["since"])
        if stalled <= self.progress_timeout_s:
            return None

        def order(status: str) -> tuple:
            step, _ = parse_status(status)
            return (-1 if step is None else step, status)
        working = {r: v for r, v in statuses.items() if not is_waiting(parsed[r][1])}
        earliest = min((working or statuses).values(), key=order)
        behind = [self.describe(r) for r, v in sorted(statuses.items()) if v == earliest]
        others = sorted({v for v in statuses.values() if v != earliest})
        return (f"{', '.join(behind)} made no progress for {stalled:.1f}s (ft.progress_timeout_s={self.progress_timeout_s:g}), "
                f"stuck in {earliest!r}" + (f" while the others wait in {others}" if others else ""))

    def _publish(self, store, abort_key: str, verdict: str) -> None:
        report = dead_rank_report(self.run_dir, self.restart)
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(verdict + "\n")
        store.set(abort_key, verdict)
        # the others poll every interval: give them a beat to read the verdict before the
        # store (hosted by this process) goes away
        time.sleep(min(2 * self.interval_s, 5.0))

    def _abort(self, verdict: str, store) -> None:
        self.detected = verdict
        msg = f"hpc_rl: {self.describe(self.rank)} aborting: {verdict}"
        if self.log is not None:
            self.log.error(msg)
        print(msg, file=sys.stderr, flush=True)
        report = dead_rank_report(self.run_dir, self.restart)
        if not report.exists():
            report.parent.mkdir(parents=True, exist_ok=True)
            report.write_text(verdict + "\n")
        self.exit_fn(ABORT_EXIT_CODE)

"""A process on the cluster that is not one of a job's ranks (issue 29's attack test).

It learns the job's store address as any user of the cluster can: the job id and the nodes
of its first component from `squeue`, the node's address from `scontrol`, and the port from
hpc_rl's public formula (runtime/identity.py `rendezvous_port`). It connects with a plain
`torch.distributed.TCPStore` client, without the job's secret, as soon as the store listens
(event: the connection succeeds), and at once:

(a) puts a pickle whose unpickling would create a file under the refit readiness keys
    (`refit/<restart>/ready/<refit>/<rank>`) of every refit the run will make: the generator
    waits on them while the trainers train, the trainers and the engine's worker while the
    others get ready;
(b) writes forged abort verdicts under the heartbeats' abort key (`hb/<restart>/abort`,
    which every rank's heartbeat reads each beat) and the refit group's abort key;
(c) registers as ranks in the rendezvous: a forged record under every rank that has not
    announced itself yet (compare_set: it never overwrites a genuine record, so the run can
    still start) and a bumped arrival counter, so every rank that waits looks at once.

(a) and (b) are written before the reads they target can start (heartbeats start after the
rendezvous, refits after a step), so the test times nothing by sleeping; (c) races the
ranks' own announcements, so what landed is returned and the test asserts on it only then.
"""

from __future__ import annotations

import json
import pickle
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch.distributed as dist

from hpc_rl.refit.transport import ready_key
from hpc_rl.rundir import RunDir
from hpc_rl.runtime.identity import rendezvous_port

FORGED_VERDICT = "trainer:1 missed heartbeats for 99.0s (ft.heartbeat_timeout_s=30); forged by a neighbour"
FORGED_RECORD = json.dumps({"role": "trainer", "role_rank": 0, "node": "neighbour", "local_rank": 0})


class Payload:
    """Unpickling it creates a file: what a stranger's pickle could do as the job's user."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


class Submitted:
    """A job submitted without waiting (hpc_rl.slurm.chaos.launch): no launcher process to
    watch; the job is over once its exit record says it will not come back."""

    def __init__(self, run: Path):
        self.run = run

    def poll(self):
        try:
            ex = json.loads(RunDir(self.run).job_exit.read_text())
        except (OSError, ValueError):
            return None
        return None if ex.get("requeued") else ex.get("exit_code", 1)


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout


def job_id_of(run: Path) -> Optional[str]:
    try:  # the id squeue shows every user; the test reads it where its launcher put it
        return str(json.loads(RunDir(run).job_meta.read_text())["job_id"])
    except (OSError, ValueError, KeyError):
        return None


def store_address(job_id: str, restart: int = 0) -> Optional[Tuple[str, int]]:
    """What any cluster user can learn once the job runs: trainer rank 0 (the store's host)
    is the first task of component 0; the port follows from the job id."""
    for line in _sh("squeue", "-h", "-j", job_id, "-o", "%i|%T|%N").splitlines():
        jid, state, nodes = (line.split("|") + ["", "", ""])[:3]
        if jid in (job_id, f"{job_id}+0") and state == "RUNNING" and nodes:
            first = _sh("scontrol", "show", "hostnames", nodes).split()[0]
            info = _sh("scontrol", "show", "node", first)
            addr = next((w.split("=", 1)[1] for w in info.split() if w.startswith("NodeAddr=")), first)
            return addr, rendezvous_port(job_id, restart)
    return None


def _listening(address: Tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=1).close()
        return True
    except OSError:
        return False


def attack(run: Path, proc: subprocess.Popen, marker: Path, world: int, refit_world: int, refits: int,
           deadline_s: float = 600.0, restart: int = 0) -> Dict[str, object]:
    """Wait for the store of the job's attempt `restart`, then forge (a), (b) and (c) under
    that attempt's keys; returns what was written."""
    end = time.monotonic() + deadline_s
    address, store, looked = None, None, 0.0
    while store is None:
        if proc.poll() is not None or time.monotonic() > end:
            raise AssertionError(f"the neighbour never reached the job's store (address {address}, launch rc "
                                 f"{proc.poll()})")
        if address is None or (restart > 0 and time.monotonic() - looked > 1.0):  # a requeue may move it
            job_id, looked = job_id_of(run), time.monotonic()
            address = store_address(job_id, restart) if job_id else None
            if address is None:
                time.sleep(0.2)
                continue
        if not _listening(address):  # a plain connect, every 20 ms: the store's first moment counts for (c)
            time.sleep(0.02)
            continue
        store = dist.TCPStore(address[0], address[1], is_master=False, timeout=timedelta(seconds=30))
    # (c) forged registrations where no genuine record is yet, then "everyone arrived"
    landed = [r for r in range(world)
              if store.compare_set(f"rdzv/{restart}/{r}", "", FORGED_RECORD) == FORGED_RECORD.encode()]
    store.add(f"rdzv/{restart}/arrived", world)
    # (b) forged verdicts
    store.set(f"hb/{restart}/abort", FORGED_VERDICT)
    store.set(f"refit/{restart}/abort", "generator:0: forged by a neighbour")
    # (a) a pickle that would create `marker`, under every readiness key of the run's refits
    blob = pickle.dumps(Payload(str(marker)))
    ready = [ready_key(f"refit/{restart}", n, r) for n in range(1, refits + 1) for r in range(refit_world)]
    planted = [k for k in ready if store.compare_set(k, "", blob) == blob]
    return {"address": address, "rdzv_landed": landed, "ready_planted": planted}

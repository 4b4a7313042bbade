"""vLLM engines that span several generator tasks.

An engine has tp*pp workers. A generator task hosts `engine_workers_per_task` of them (one
GPU each on GPU nodes; on CPU as many as its cores allow), so one engine covers
`engine_tasks` consecutive generator tasks (config/resources.py). It runs as vLLM's
multi-node multiprocessing executor: each task is one of the engine's "nodes" and starts
its workers as child processes. The engine's first task (its leader) also runs the
scheduler and the `LLM`; vLLM's collective RPCs from there reach every worker of every
task, so the refit (each worker a refit rank: engine g, TP rank j) and the stamping of
weight versions work as for an engine inside one task. The other tasks (followers) host
workers only, watch them, and wait for the run's end.

Why not vLLM's external launcher (each task one rank calling the engine with the same
prompts and seed)? Read and tried on vllm 0.32 (CPU, two processes):
- it runs the engine inside the task's own process and takes torch.distributed's default
  group as its world; our ranks already own that group (the job's world, runtime/groups.py),
  so each engine would need a child process of its own anyway;
- every task runs a scheduler of its own and they must stay in step: an in-flight refit
  landing between scheduler steps would need the tasks to agree on the step first;
- on CPU its shared-memory communicator is named from "env://", so two engines on one host
  collide (and a killed engine's leftovers make the next start fail with EEXIST).
The multi-node executor has one scheduler per engine, keeps vLLM's workers out of our
process group, and names its groups from the master port.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from hpc_rl.refit.vllm_engine import EngineSpan, bind_cpu_workers, engine_kwargs
from hpc_rl.runtime.death import explain

MASTER_KEY = "engine/{restart}/{engine}/master"  # host:port where engine g's workers meet
DEAD_KEY = "engine/{restart}/{engine}/dead"  # a follower's report of its dead worker, for the leader
WATCH_S = 1.0  # how often a follower looks at its workers and at the run's end


@dataclass(frozen=True)
class EngineSeat:
    """A generator task's place: engine `engine`, its `node`-th task of `tasks`."""

    engine: int
    node: int
    tasks: int

    @property
    def leader(self) -> bool:
        return self.node == 0

    def __str__(self) -> str:
        return f"engine {self.engine} task {self.node}/{self.tasks}"


def seat_of(role_rank: int, engine_tasks: int) -> EngineSeat:
    return EngineSeat(role_rank // engine_tasks, role_rank % engine_tasks, engine_tasks)


def publish_master(store, restart: int, engine: int) -> Tuple[str, int]:
    """The leader picks where its engine's workers meet: this host, a free port."""
    from vllm.utils.network_utils import get_ip

    host = get_ip()
    with socket.socket() as s:  # the port is free now; vLLM's first worker binds it next
        s.bind(("", 0))
        port = s.getsockname()[1]
    store.set(MASTER_KEY.format(restart=restart, engine=engine), f"{host}:{port}")
    return host, port


def read_master(store, restart: int, engine: int) -> Tuple[str, int]:
    """Blocks (the store's timeout) until the engine's leader has published its address."""
    host, port = store.get(MASTER_KEY.format(restart=restart, engine=engine)).decode().rsplit(":", 1)
    return host, int(port)


class EngineFollower:
    """The workers one follower task hosts for its engine (vLLM's headless node)."""

    def __init__(self, seat: EngineSeat, span: EngineSpan, model_path: str, precision: str, max_model_len: int,
                 seed: int, memory_fraction: float, max_num_seqs: int, tensor_parallel: int, expert_parallel: bool = False,
                 options: Optional[Dict[str, object]] = None):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        if seat.leader:
            raise ValueError(f"{seat}: the first task runs the engine itself (VLLMGenerator)")
        self.seat = seat
        bind_cpu_workers(tensor_parallel // span.tasks, tensor_parallel)
        args = EngineArgs(**engine_kwargs(model_path, precision, max_model_len, seed, memory_fraction, max_num_seqs,
                                          tensor_parallel, span, expert_parallel, options=options))
        config = args.create_engine_config(headless=True)
        # blocks until these workers have joined the engine's process group with the leader's
        self.executor = MultiprocExecutor(config, monitor_workers=False)
        self.first_tp_rank = seat.node * (tensor_parallel // span.tasks)

    def pids(self) -> List[int]:
        return [w.proc.pid for w in self.executor.workers]

    def dead(self) -> Optional[str]:
        """What died, naming the engine and the worker (its TP rank), or None."""
        for i, w in enumerate(self.executor.workers):
            if not w.proc.is_alive():
                return (f"vLLM engine {self.seat.engine}: worker tp{self.first_tp_rank + i} (pid {w.proc.pid}, hosted by "
                        f"its task {self.seat.node}) {explain(w.proc.exitcode, w.proc.pid)}")
        return None

    def serve_until(self, ended: Callable[[], bool], on_watch: Callable[[], None] = lambda: None,
                    report: Callable[[str], None] = lambda problem: None) -> None:
        """Watch the workers until the run ends; a dead worker ends this task with its name,
        reported first for the leader (whose engine then stops on its own). After the end a
        worker may go first (the leader's engine closing): that is no error."""
        while not ended():
            problem = self.dead()
            if problem is not None and not ended():
                report(problem)
                raise RuntimeError(problem)
            on_watch()
            time.sleep(WATCH_S)

    def shutdown(self) -> None:
        self.executor.shutdown()


def report_dead_worker(store, restart: int, engine: int, problem: str) -> None:
    store.set(DEAD_KEY.format(restart=restart, engine=engine), problem)


def dead_worker_report(store, restart: int, engine: int, wait_s: float = 3 * WATCH_S) -> Optional[str]:
    """What a follower of `engine` reported dead, waiting up to `wait_s` for it: the leader
    asks when its engine stopped, to name the worker rather than only its own failure."""
    key = DEAD_KEY.format(restart=restart, engine=engine)
    deadline = time.monotonic() + wait_s
    while True:
        report = store.peek(key)  # the job's SignedStore: a forged report does not verify
        if report is not None:
            return report.decode()
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)

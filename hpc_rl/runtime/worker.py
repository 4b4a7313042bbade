"""The one entry every task of a run starts: `python -m hpc_rl.runtime.worker RUN_DIR`.

It reads the run directory (config.yaml, plan.json: never Hydra state), learns its
identity from the launcher's environment, meets the other ranks, builds the process
groups, and runs `run.program`. Its outcome is written as a submitit result pickle
(`("success", result)` or `("error", traceback)`) so submitit job handles read it, and a
failure also leaves `errors/<role>.<rank>.<restart>.txt` naming role and rank (results.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

if __name__ == "__main__":  # when this rank's interpreter started, before heavy imports (launch benchmark)
    from hpc_rl.runtime.env import T_START

    os.environ.setdefault(T_START, repr(time.time()))  # the supervisor's start, if any
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from hpc_rl.config.convert import to_typed
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.trace import write_rank_reads
from hpc_rl.observe.timing import KEEP, PhaseClock, status_text
from hpc_rl.plan.job_plan import JobPlan
from hpc_rl.rundir import role_file_name

from hpc_rl.rundir import RunDir

from . import env
from .env import RankEnv
from .faults import maybe_inject
from .identity import RankIdentity, identity_from_env, rendezvous_port
from .programs import PROGRAMS

FINISHED = RunDir.FINISHED  # kept for importers of this name; the path is RunDir(run_dir).finished


@dataclass
class RankContext:
    run_dir: Path
    cfg: RunConfig
    plan: JobPlan
    ident: RankIdentity
    store: Any
    groups: Any
    device: str
    log: logging.Logger
    timing: dict  # wall-clock seconds since the epoch: process_start, imported, rendezvoused
    placement: Any  # hpc_rl.plan.placement.JobPlacement: how segments landed on domains
    store_addr: str = "127.0.0.1"  # where the TCPStore listens (vLLM workers join refit groups through it)
    store_port: int = 0
    heartbeat: Any = None  # hpc_rl.runtime.heartbeat.Heartbeat, or None when ft.heartbeat_timeout_s = 0
    clock: Optional[PhaseClock] = None  # this rank's phase times (timing/ in the run directory)

    def set_phase(self, phase: str, step: Any = KEEP) -> None:
        """This rank is now in `phase` of training step `step` (None: outside the steps;
        omitted: the current step). One call feeds the heartbeat's status (the progress
        watchdog) and the phase clock (the timing files and the live view)."""
        if self.clock is not None:
            self.clock.enter(phase, step)
            step = self.clock.step
        elif step is KEEP:
            step = None
        if self.heartbeat is not None:
            self.heartbeat.set_status(status_text(phase, step))

    def carve_phase(self, phase: str, seconds: float) -> None:
        """`seconds` of the current phase were really `phase` (observe/timing.py PhaseClock.carve)."""
        if self.clock is not None:
            self.clock.carve(phase, seconds)

    def finish(self) -> None:
        """Call before the program's final barrier: silence from here on is not a death."""
        if self.clock is not None:
            self.clock.close()
            if self.clock.error:  # timing is best effort; say once that it is incomplete
                self.log.warning("phase timing incomplete: %s", self.clock.error)
        if self.heartbeat is not None:
            self.heartbeat.finish()


def load_run(run_dir: Path) -> tuple:
    rd = RunDir(run_dir)
    data = OmegaConf.to_container(OmegaConf.load(rd.config), resolve=True)
    cfg, errors = to_typed(RunConfig, data)
    if errors:
        raise RuntimeError(f"{rd.config} does not match this version's schema: "
                           + "; ".join(v.render() for v in errors))
    plan = JobPlan.from_dict(json.loads(rd.plan.read_text()))
    return cfg, plan


def rank_logger(ident: RankIdentity) -> logging.Logger:
    log = logging.getLogger(f"hpc_rl.{ident.role}.{ident.role_rank}")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(f"%(asctime)s [{ident.role}:{ident.role_rank}] %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
        # the adapted environments' bridges (NeMo Gym, verifiers) log under hpc_rl.agentic: their
        # servers' start, what they reaped; into this rank's log, not lost at INFO
        lib = logging.getLogger("hpc_rl.agentic")
        if not lib.handlers:
            lib.addHandler(handler)
            lib.setLevel(logging.INFO)
            lib.propagate = False
    return log


def start_heartbeat(cfg: RunConfig, plan: JobPlan, ident: RankIdentity, run_dir: Path, addr: str, port: int, log):
    from .heartbeat import Heartbeat
    from .rendezvous import describe_rank

    if cfg.ft.heartbeat_timeout_s <= 0:
        return None
    return Heartbeat(addr, port, ident.global_rank, ident.world_size, ident.restart, lambda r: describe_rank(plan, r),
                     run_dir, cfg.ft.heartbeat_interval_s, cfg.ft.heartbeat_timeout_s, log,
                     progress_timeout_s=cfg.ft.progress_timeout_s).start()


def run_rank(run_dir: str, environ: Optional[dict] = None) -> Any:
    from .groups import build_groups, configure_device  # imports torch: most of a rank's start-up
    from .placement import compute_placement, node_facts, placed_identity, write_report
    from .rendezvous import connect_store, rendezvous
    from .signed_store import job_key

    t_imported = time.time()
    secret = job_key(environ)  # no secret, no rank: fail before touching the network

    run_path = Path(run_dir)
    rd = RunDir(run_path)
    cfg, plan = load_run(run_path)
    ident = identity_from_env(plan, environ)
    log = rank_logger(ident)
    role = plan.role(ident.role)
    device = configure_device(ident, role.gpus_per_node, cfg.cluster.cpus_per_node, role.tasks_per_node)
    launched = RankEnv.from_env(environ)
    addr = launched.master_addr or "127.0.0.1"
    port = launched.master_port or rendezvous_port(ident.job_id, ident.restart)
    timeout = float(cfg.run.rendezvous_timeout_s)
    log.info("starting %s on %s; rendezvous at %s:%d (restart %d)", ident, device, addr, port, ident.restart)
    t0 = time.perf_counter()
    store = connect_store(ident, plan, addr, port, timeout, secret)
    announced = rendezvous(store, ident, plan, timeout, facts=node_facts())
    placement, mapping = compute_placement(cfg, plan, announced, run_path, ident.restart)
    ident = placed_identity(ident, mapping, plan)
    # results and error reports are filed under the placed ranks
    os.environ[env.PLACED_RANK] = str(ident.global_rank)
    os.environ[env.PLACED_ROLE_RANK] = str(ident.role_rank)
    if placement.roles or ident.global_rank == 0:
        log.info("placement: topology source %s (%s); %s", placement.source, placement.detail,
                 "; ".join(f"{r}: segments in {sorted(set(p.segment_domains))}" for r, p in placement.roles.items())
                 or "no role has multi-node segments")
    if placement.roles and ident.global_rank == 0:
        write_report(run_path, ident.restart, placement)
    groups = build_groups(store, ident, plan, timeout)
    log.info("rendezvoused with %d ranks in %.2fs", ident.world_size, time.perf_counter() - t0)
    timing = {"process_start": launched.t_start or t_imported, "imported": t_imported,
              "rendezvoused": time.time()}
    heartbeat = start_heartbeat(cfg, plan, ident, run_path, addr, port, log)
    maybe_inject(cfg.ft.inject_failure, ident.role, ident.role_rank, ident.restart)
    if cfg.run.program not in PROGRAMS:
        raise RuntimeError(f"run.program={cfg.run.program!r} is not available in this version (have {sorted(PROGRAMS)})")
    ctx = RankContext(run_path, cfg, plan, ident, store, groups, device, log, timing, placement, addr, port, heartbeat,
                      PhaseClock(run_path, ident.role, ident.role_rank, ident.restart, ident.node))
    ctx.set_phase("setup", None)
    try:
        result = PROGRAMS[cfg.run.program]()(ctx)
    except BaseException as exc:
        if getattr(exc, "no_retry", False):  # the batch shell does not requeue what cannot succeed
            fatal = rd.fatal(ident.restart)
            fatal.parent.mkdir(parents=True, exist_ok=True)
            fatal.write_text(f"{ident.role}:{ident.role_rank}: {type(exc).__name__}: {exc}\n")
        if heartbeat is not None:
            # a peer's death shows here as 'connection closed': find out whom we lost
            verdict = heartbeat.report_dead_peers(store, f"{type(exc).__name__}: {str(exc)[:200]}")
            if verdict:
                log.error("%s", verdict)
        raise
    finally:  # the evidence that config keys are honoured (config/trace.py, tests/test_config_keys.py)
        write_rank_reads(run_path, role_file_name(ident.role), ident.role_rank, ident.restart)
    ctx.finish()
    if ident.global_rank == 0 and not (isinstance(result, dict) and "stopped_after" in result):
        # the run is complete: the batch shell never requeues it, a resubmission does nothing
        rd.finished.write_text(f"{time.time()}\n")
    _shutdown()
    return result


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: Optional[list] = None) -> int:
    """Local launcher entry: run this rank and record its outcome like submitit does."""
    from .results import run_and_record

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpc_rl.runtime.worker RUN_DIR", file=sys.stderr)
        return 2
    return run_and_record(Path(args[0]), lambda: run_rank(args[0]))


if __name__ == "__main__":
    from hpc_rl.runtime.supervise import exit_now, is_child, supervise

    # the rank itself runs in a child; this process cleans up after it (supervise.py)
    if is_child():
        exit_now(main())
    sys.exit(supervise("hpc_rl.runtime.worker", sys.argv[1:], run_dir=(sys.argv[1:] or [None])[0]))

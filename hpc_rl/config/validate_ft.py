"""ft.*: fault tolerance's keys. Failure injection (runtime/faults.py's FORMAT, each spec naming
a role of this job), rank heartbeats and their timeout, the progress watchdog and the requeue
budget. validate.py's check_launch runs it."""

from __future__ import annotations

from typing import List

from .errors import Violation
from .resources import role_sections
from .schema import RunConfig


def check_ft(out: List[Violation], cfg: RunConfig) -> None:
    spec = cfg.ft.inject_failure
    if spec is not None:
        from hpc_rl.runtime.faults import FORMAT, parse_injections

        names = [name for name, _, _ in role_sections(cfg)]
        try:
            injections = parse_injections(spec)
            bad = any(inj.role not in names for inj in injections)
            for inj in injections:
                if isinstance(inj.step, str) and inj.step.startswith("train") and inj.role != "trainer":
                    out.append(Violation("ft.inject_failure", spec, "@train<step> fires in the trainer's train phase: "
                                         "only trainer ranks have one", f"e.g. ft.inject_failure=trainer:0:stall20@{inj.step}"))
        except ValueError:
            bad = True
        if bad:
            out.append(Violation("ft.inject_failure", spec,
                                 f"must be {FORMAT}, several joined by '+', each naming a role of this job",
                                 f"roles: {names}, e.g. ft.inject_failure={names[min(1, len(names) - 1)]}:0"))
    ft = cfg.ft
    if ft.heartbeat_timeout_s < 0 or (ft.heartbeat_timeout_s > 0 and ft.heartbeat_interval_s <= 0):
        out.append(Violation("ft.heartbeat_timeout_s", ft.heartbeat_timeout_s, "needs a timeout >= 0 and an interval > 0",
                             "e.g. ft.heartbeat_interval_s=1 ft.heartbeat_timeout_s=30 (0 turns heartbeats off)"))
    elif ft.heartbeat_timeout_s > 0 and ft.heartbeat_timeout_s < 3 * ft.heartbeat_interval_s:
        out.append(Violation("ft.heartbeat_timeout_s", ft.heartbeat_timeout_s, "must cover at least 3 heartbeat intervals",
                             f"raise it to >= {3 * ft.heartbeat_interval_s:g} or lower ft.heartbeat_interval_s"))
    if ft.progress_timeout_s < 0:
        out.append(Violation("ft.progress_timeout_s", ft.progress_timeout_s, "must be >= 0", "0 turns the progress watchdog off"))
    if ft.max_restarts < 0:
        out.append(Violation("ft.max_restarts", ft.max_restarts, "must be >= 0", "0 never requeues"))

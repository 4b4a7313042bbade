"""The env role: verifies the rows of the generators routed to it and sends the rewards
(and correctness, for accuracy) to the driver."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

from hpc_rl.agentic.faults import error_kind, traceback_line
from hpc_rl.envs.math_verifier import VerifierResult
from hpc_rl.envs.registry import REASON_CHARS, score
from hpc_rl.messaging import p2p as exchange
from hpc_rl.messaging.messages import END, STOP, Work
from hpc_rl.messaging.routes import Routes
from hpc_rl.runtime.faults import maybe_inject


class ScoringErrors:
    """The rows whose scoring failed on this env rank (a verifier raised, or returned a reward
    reward_check refuses): counted by kind, each kind logged once with its first row, task
    and reason (a thousand alike write one line). The counts go into the rank's result."""

    def __init__(self, log: Optional[logging.Logger] = None):
        self.log = log or logging.getLogger(__name__)
        self.by_kind: Dict[str, int] = {}

    def add(self, res: VerifierResult, rec, step: Optional[int] = None) -> None:
        kind = res.error or "error"
        if kind not in self.by_kind:
            self.log.warning("scoring row %s (task %r%s) failed with %s (scored 0, counted in the env rank's "
                             "scoring_errors_by_kind; logged once per kind): %s", rec.id, rec.task,
                             f", step {step}" if step is not None else "", kind, res.reason)
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


def verify(items, errors: Optional[ScoringErrors] = None, step: Optional[int] = None) -> List[Tuple[int, float, Optional[bool]]]:
    """(index, reward, correct) per row; a row without a verifier gets no reward and is
    not counted in accuracy. Never raises over a row: one whose scoring fails scores 0 (and
    incorrect) and is counted in `errors`, so no response or row can stop the rank."""
    errors = errors if errors is not None else ScoringErrors()
    out = []
    for i, rec, row in items:
        if rec.task is None or rec.answer is None:
            out.append((i, 0.0, None))
            continue
        try:
            res = score(rec.task, row.text, rec.answer)
        except Exception as exc:  # a task without a verifier (refused at load: a bug) or score's own
            res = VerifierResult(False, 0.0, None, traceback_line(exc)[:REASON_CHARS], error_kind(exc))
        if res.error is not None:
            errors.add(res, rec, step)
        out.append((i, res.reward, res.correct))
    return out


class EnvRole:
    def __init__(self, ctx, routes: Routes):
        self.ctx, self.routes = ctx, routes
        self.rank = ctx.ident.global_rank
        self.sources = [routes.generators[g] for g in routes.generators_of_env(self.rank)]
        self.episodes = None  # multi-turn collections (roles/episode_runner.py)
        self.scoring_errors = ScoringErrors(ctx.log)  # single-turn rows whose scoring failed
        if ctx.cfg.env.agentic.environment and self.sources:
            from hpc_rl.roles.episode_runner import EpisodeRunner

            self.episodes = EpisodeRunner(ctx)

    def _start_step(self, first, done: Dict[str, Any]) -> None:
        """A training round (Work or Episodes) opens its step here: counted, marked, and
        where ft.inject_failure's @step fires."""
        if not first.train:
            return
        done["steps"] += 1
        exchange.mark_step(first.step)
        ident = self.ctx.ident
        maybe_inject(self.ctx.cfg.ft.inject_failure, ident.role, ident.role_rank, ident.restart, first.step)

    def _episodes(self, work, done: Dict[str, Any]) -> None:
        from hpc_rl.roles.episode_runner import serve_episodes

        first = work[0]
        self.ctx.set_phase("episodes" if first.train else "eval", first.step if first.train else None)
        self._start_step(first, done)
        out = serve_episodes(self.episodes, work, self.sources, self.routes.driver, self.ctx.set_phase)
        done["episodes"] = done.get("episodes", 0) + out["episodes"]

    def serve(self) -> Dict[str, Any]:
        done: Dict[str, Any] = {"role": "env", "rank": self.ctx.ident.role_rank, "rounds": 0, "steps": 0}
        if not self.sources:  # more env ranks than generators: nothing is routed here
            done["idle"] = True
            return done
        while True:
            self.ctx.set_phase("wait")  # for the rows of this rank's generators
            work: List[Work] = [exchange.recv(src) for src in self.sources]
            done["rounds"] += 1
            if not isinstance(work[0], Work):  # a multi-turn collection: Episodes (roles/episodes.py)
                self._episodes(work, done)
                continue
            kind = work[0].kind
            busy = "verify" if work[0].train else "eval"
            self.ctx.set_phase(busy if work[0].wanted else "wait", work[0].step if work[0].train else None)
            self._start_step(work[0], done)
            if kind in (STOP, END):
                if self.episodes is not None:  # before the rank's os._exit: atexit would not run
                    self.episodes.shutdown()
                return dict(done, stopped=True) if kind == STOP else done
            if work[0].wanted:
                scores = verify([it for w in work for it in w.items], self.scoring_errors,
                                work[0].step if work[0].train else None)
                done["scoring_errors"] = self.scoring_errors.total
                done["scoring_errors_by_kind"] = dict(self.scoring_errors.by_kind)
                self.ctx.set_phase("wait_send")  # the send returns once the driver takes it
                exchange.send(scores, self.routes.driver)

"""The env role: verifies the rows of the generators routed to it and sends the rewards
(and correctness, for accuracy) to the driver."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from hpc_rl.envs.registry import score
from hpc_rl.messaging import p2p as exchange
from hpc_rl.messaging.messages import END, STOP, Work
from hpc_rl.messaging.routes import Routes
from hpc_rl.runtime.faults import maybe_inject


def verify(items) -> List[Tuple[int, float, Optional[bool]]]:
    """(index, reward, correct) per row; a row without a verifier gets no reward and is
    not counted in accuracy."""
    out = []
    for i, rec, row in items:
        if rec.task is None or rec.answer is None:
            out.append((i, 0.0, None))
            continue
        res = score(rec.task, row.text, rec.answer)
        out.append((i, float(res.reward), bool(res.correct)))
    return out


class EnvRole:
    def __init__(self, ctx, routes: Routes):
        self.ctx, self.routes = ctx, routes
        self.rank = ctx.ident.global_rank
        self.sources = [routes.generators[g] for g in routes.generators_of_env(self.rank)]
        self.episodes = None  # multi-turn collections (roles/episode_runner.py)
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
                scores = verify([it for w in work for it in w.items])
                self.ctx.set_phase("wait_send")  # the send returns once the driver takes it
                exchange.send(scores, self.routes.driver)

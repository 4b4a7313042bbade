"""The generator role: samples on its inference engine when the driver orders it, and
sends each row to the ranks that consume it (its env rank, the teacher group the row is
routed to, the driver). Between orders it receives refits."""

from __future__ import annotations

import time
from typing import Any, Dict, List

from hpc_rl.algo.routing import TeacherRouter
from hpc_rl.config.resources import REFERENCE
from hpc_rl.engines.base import EngineSpec, InferenceEngine
from hpc_rl.engines.kv_capacity import kv_capacity_warning
from hpc_rl.engines.registry import build_engine, build_follower
from hpc_rl.engines.spanning import dead_worker_report, publish_master, read_master, report_dead_worker, seat_of
from hpc_rl.messaging import p2p as exchange
from hpc_rl.messaging.messages import COLLECT, END, FORWARDED, IN_FLIGHT_KEY, REFIT, STOP, TEACHER_EVAL, Order, Work
from hpc_rl.messaging.routes import Routes
from hpc_rl.refit.adapter_refit import engine_lora_options
from hpc_rl.refit.vllm_engine import EngineSpan
from hpc_rl.runtime.faults import maybe_inject


STEP_KEY = "engine/{restart}/{engine}/step"  # the training step an engine's leader samples (for its followers)


def engine_spec(ctx, engine: int, span: EngineSpan = EngineSpan()) -> EngineSpec:
    """Engine g's arguments, the same in every task it spans."""
    cfg, g = ctx.cfg, ctx.cfg.generator
    lora = cfg.trainer.lora
    adapter = lora.enabled and lora.refit == "adapter"  # engines serve the student's adapter
    return EngineSpec(cfg.model.path, g, max_model_len=g.max_model_len or cfg.trainer.max_seq_len,
                      seed=cfg.run.seed + engine, on_gpu=ctx.device.startswith("cuda"), span=span,
                      lora=engine_lora_options(lora) if adapter else None)


class GeneratorRole:
    """An engine's first task: it runs the engine and serves the driver's orders."""

    def __init__(self, ctx, routes: Routes):
        cfg = ctx.cfg
        self.ctx, self.cfg, self.routes, self.log = ctx, cfg, routes, ctx.log
        self.seat = seat_of(ctx.ident.role_rank, routes.engine_tasks)
        self.index = self.seat.engine  # the engine's index: routes.generators lists engine leaders
        self.router = TeacherRouter.from_config(cfg) if routes.teachers else None
        g = cfg.generator
        span = EngineSpan()
        if self.seat.tasks > 1:
            host, port = publish_master(ctx.store, ctx.ident.restart, self.index)
            span = EngineSpan(self.seat.tasks, 0, host, port)
            self.log.info("engine %d spans generator tasks %d-%d; its workers meet at %s:%d", self.index,
                          ctx.ident.role_rank, ctx.ident.role_rank + self.seat.tasks - 1, host, port)
        spec = engine_spec(ctx, self.index, span)
        self.engine: InferenceEngine = build_engine(g.backend, spec)
        self.log.info("%s engine up (%s, %s)", g.backend, g.precision, ctx.device)
        self._check_kv_capacity(spec.max_model_len, routes)
        asy = cfg.algo.async_rollout
        self.recompute_kv = asy.recompute_kv_cache_after_weight_updates  # read here: honoured by refit_in_flight
        self.in_flight: Dict[str, Any] = {}  # the in-flight refit of the order being sampled
        self.refit_prefix, self.refits = "", 0  # the refit group's store namespace; refits received
        self.adapter_refit = False  # trainer.lora.refit=adapter (join_refit says)
        self.episodes = None  # multi-turn collections: the engine's endpoint (roles/episodes.py)
        if cfg.env.agentic.environment:
            from hpc_rl.roles.episodes import EngineEndpoint

            self.episodes = EngineEndpoint(ctx, self.engine, self.index)
        self.episode_stats: Dict[str, float] = {}  # the last multi-turn collection's (sent with its rows)

    def join_refit(self) -> None:
        """The driver sends the refit setup; the engine checks the destination layout
        against its live model (a mismatch stops the run here, before any step) and its
        workers join the refit group."""
        from hpc_rl.models.families import hf_config
        from hpc_rl.refit.layout import Layout
        from hpc_rl.refit.engine_group import engine_first_rank
        from hpc_rl.refit.vllm_layout import check_against_model

        setup = exchange.recv(self.routes.driver)
        self.adapter_refit = isinstance(setup, dict) and "adapter_prefix" in setup
        if self.adapter_refit:  # trainer.lora.refit=adapter: no weights plan, the adapter (refit/adapter_refit.py)
            self.refit_prefix = setup["adapter_prefix"]
            # refit 0, the trainer's adapter as built: every request carries it from the first on, so an
            # in-flight load reaches the running ones (refit/adapter_refit.py); the version stays
            out = self.engine.load_adapter(self.ctx.store, self.refit_prefix, 0, None)
            self.log.info("engine %d gets the student's LoRA adapter at each refit (initial one loaded in %.2fs)",
                          self.index, out["refit_s"])
            return
        check_against_model({n: (t.shape, t.dtype) for n, t in Layout.from_dict(setup.dst).tensors.items()},
                            self.engine.params(), self.engine.tensor_parallel, expert_parallel=self.engine.expert_parallel,
                            hf_config=hf_config(self.cfg.model.path))
        first = engine_first_rank(len(self.routes.trainer), self.index, self.engine.tensor_parallel)
        out = self.engine.join_refit(setup, first, self.ctx.store_addr, self.ctx.store_port)
        self.refit_prefix = setup.prefix
        # engine g's workers are refit ranks first + their TP rank (generator:g/tp<j>)
        self.log.info("engine %d joined the refit group: %d worker(s) as refit ranks %s", self.index,
                      self.engine.tensor_parallel, out.get("ranks"))

    def serve(self) -> Dict[str, Any]:
        """Orders until the run ends or stops; returns what this rank did. When the engine
        stops because a worker in a follower task died, the error names that worker."""
        try:
            done = self._serve()
            self._count_workers_auth()
            if self.episodes is not None:
                self.episodes.close()
            self.engine.close()  # the run is over for this engine: do not wait on vLLM's shutdown
            return done
        except Exception as exc:
            report = dead_worker_report(self.ctx.store, self.ctx.ident.restart, self.index) if self.seat.tasks > 1 else None
            if report is None:
                raise
            raise RuntimeError(f"{report}; the engine stopped ({type(exc).__name__})") from exc

    def _count_workers_auth(self) -> None:
        """The engine's workers are processes of their own that read refit keys: their
        rejections join this rank's report (runtime/auth_stats.py)."""
        from hpc_rl.runtime import auth_stats

        try:
            auth_stats.add_workers(self.engine.auth_counts())
        except Exception as exc:  # a report, never a reason to fail a finished run
            self.log.warning("the engine's workers' authentication counts are missing from the summary: %s", exc)

    def _serve(self) -> Dict[str, Any]:
        done = {"role": "generator", "rank": self.index, "orders": 0, "steps": 0}
        while True:
            self.ctx.set_phase("wait")  # for the driver's next order
            order: Order = exchange.recv(self.routes.driver)
            done["orders"] += 1
            if order.train:  # a training step's collection
                self.ctx.set_phase("sample", order.step)
            else:  # evaluations, a resume's refit and the end lie outside the training steps
                self.ctx.set_phase("eval" if order.kind == COLLECT else order.kind, None)
            if order.kind == REFIT:
                out = self._refit(order.step)
                self.log.debug("refit to version %d: %s", order.step, out)
                continue
            if order.train:
                done["steps"] += 1
                exchange.mark_step(order.step)
                ident = self.ctx.ident
                if self.seat.tasks > 1:  # the followers' injected failures fire at their engine's steps
                    self.ctx.store.set(STEP_KEY.format(restart=ident.restart, engine=self.index), str(order.step))
                maybe_inject(self.cfg.ft.inject_failure, ident.role, ident.role_rank, ident.restart, order.step)
            self._forward(order)
            if order.kind == COLLECT and order.refit_after is not None:  # the order says which weights follow
                self._refit(order.refit_after)
            if order.kind == STOP:
                return dict(done, stopped_after=order.step)
            if order.kind == END:
                return done

    def _refit(self, version: int, in_flight: bool = False) -> Dict[str, Any]:
        """Receive the trainer's weights of step `version`. First wait, in phase wait_refit
        and with no deadline, until the trainer ranks are ready to send (they may still be
        training: the heartbeats and the progress watchdog watch them meanwhile); the
        refit.timeout_s deadline then bounds the transfer alone (refit/transport.py ready)."""
        from hpc_rl.refit.transport import wait_ready

        self.refits += 1
        if not in_flight:  # in flight, the driver announced it once the trainer was ready
            self.ctx.set_phase("wait_refit")
        if not self.adapter_refit:  # the adapter's wait is on its own key (load_adapter)
            wait_ready(self.ctx.store, self.refit_prefix, self.refits, range(len(self.routes.trainer)),
                       abort_key=f"{self.refit_prefix}/abort")
        if self.adapter_refit:  # in flight: between scheduler steps, the scheduler paused (load_adapter)
            if not in_flight:
                self.ctx.set_phase("refit")
            out = self.engine.load_adapter(self.ctx.store, self.refit_prefix, self.refits, version, in_flight,
                                           self.recompute_kv)
            if not in_flight:
                self.ctx.carve_phase("wait_refit", float(out["wait_s"]))  # the trainer still training
            return out
        if in_flight:
            return self.engine.refit_in_flight(version, self.cfg.refit.timeout_s, self.recompute_kv)
        self.ctx.set_phase("refit")
        out = self.engine.refit(version, self.cfg.refit.timeout_s)
        self.ctx.carve_phase("wait_refit", float(out.get("wait_s", 0.0)))  # blocked on the transport
        return out

    def _check_kv_capacity(self, max_model_len: int, routes: Routes) -> None:
        """Warn when this engine's KV cache cannot hold a step's samples at once (kv_capacity.py)."""
        if not hasattr(self.engine, "kv_cache_tokens"):
            return
        kv, block = self.engine.kv_cache_tokens
        a = self.cfg.algo
        per_step = -(-a.prompts_per_step * a.generations_per_prompt // max(len(routes.generators), 1))
        warning = kv_capacity_warning(kv, block, max_model_len, per_step, self.cfg.generator.gpu_memory_utilization)
        if warning:
            self.log.warning("engine %d: %s", self.index, warning)
        else:
            self.log.info("engine %d: KV cache of %d tokens", self.index, kv)

    def _poll_in_flight(self) -> None:
        """Between scheduler steps: once the driver announces the refit, load it mid-generation."""
        f = self.in_flight
        if f["landed"] or not self.ctx.store.check([IN_FLIGHT_KEY.format(restart=self.ctx.ident.restart, version=f["version"])]):
            return
        out = self._refit(f["version"], in_flight=True)
        f["landed"] = True
        self.log.debug("in-flight refit to version %d: %s", f["version"], out)

    def _forward(self, order: Order) -> None:
        """Sample (COLLECT), then send every consumer its part: scorers first, so scoring
        starts while the driver still collects the other engines' rows."""
        assert order.kind in FORWARDED, order.kind
        rows: List[Any] = [None] * len(order.items)
        t0 = time.perf_counter()
        self.in_flight = {"version": order.refit_in_flight, "landed": order.refit_in_flight is None}
        env = self.routes.env_of(self.index)
        poll = self._poll_in_flight if order.refit_in_flight is not None else None
        multi_turn = order.kind == COLLECT and self.episodes is not None
        siblings: List[Any] = []  # ((index, k), record, row): earlier samples of rewritten histories (rl/siblings.py)
        if multi_turn:  # the env rank runs the episodes against the endpoint; it scores them itself
            groups, self.episode_stats = self.episodes.collect(order, env, poll)
            rows = [g[-1] for g in groups]
            siblings = [((i, k), rec, r) for (i, rec, _), g in zip(order.items, groups) for k, r in enumerate(g[:-1], 1)]
        elif order.kind == COLLECT and order.items:
            rows = self.engine.sample([r.prompt for _, r, _ in order.items], order.sampling,
                                      [seed for _, _, seed in order.items], between_steps=poll)
        gen_s = time.perf_counter() - t0
        self.ctx.set_phase("wait_send")  # each send returns once its consumer takes it
        items = [(i, rec, row) for (i, rec, _), row in zip(order.items, rows)]
        if env is not None and not multi_turn:
            exchange.send(Work(order.kind, order.kind == COLLECT and order.score_env, order.step, order.train, items), env)
        wanted_t = order.kind == TEACHER_EVAL or (order.kind == COLLECT and order.score_teachers)
        wanted_ref = order.kind == COLLECT and order.score_reference
        scored = items + siblings  # a sibling is scored like any row, under its (index, k) key
        # routed only when the teachers score (a run whose one group is the reference routes no agent)
        by_group = self.router.split_by_group([rec.agent for _, rec, _ in scored]) if wanted_t and self.routes.teachers else {}
        for group in self.routes.teachers:  # every head hears from every generator, even with nothing routed
            # the reference model's group scores every row (and, a teacher too, answers its routed ones)
            ref = wanted_ref and self.router.group_of(REFERENCE) == group
            mine = scored if ref else [scored[k] for k in by_group.get(group, [])]
            exchange.send(Work(order.kind, wanted_t or ref, order.step, order.train, mine, reference=ref),
                          self.routes.teacher_head(group))
        if not self.in_flight["landed"]:  # sampling ended first: the trainer sends it after its train step
            self._refit(order.refit_in_flight)
        if order.kind == COLLECT:
            exchange.send((self.engine.weight_version, [(i, row) for i, _, row in scored], gen_s,
                           self.episode_stats if multi_turn else {}), self.routes.driver)


class EngineFollowerRole:
    """A later task of an engine spanning several: it hosts some of the engine's workers
    (each a refit rank, driven by the leader's RPCs), watches them and waits for the end."""

    def __init__(self, ctx, routes: Routes):
        self.ctx, self.log = ctx, ctx.log
        ident = ctx.ident
        self.seat = seat_of(ident.role_rank, routes.engine_tasks)
        host, port = read_master(ctx.store, ident.restart, self.seat.engine)
        span = EngineSpan(self.seat.tasks, self.seat.node, host, port)
        self.follower = build_follower(ctx.cfg.generator.backend, engine_spec(ctx, self.seat.engine, span), self.seat)
        self.log.info("%s: hosting the engine's workers from tp%d, pids %s (engine leader: generator rank %d)",
                      self.seat, self.follower.first_tp_rank, self.follower.pids(), ident.role_rank - self.seat.node)
        self._step = 0

    def _watch(self) -> None:
        """ft.inject_failure on this rank fires at the steps its engine's leader samples."""
        ident = self.ctx.ident
        key = STEP_KEY.format(restart=ident.restart, engine=self.seat.engine)
        published = self.ctx.store.peek(key) if self.ctx.cfg.ft.inject_failure else None
        if published is None:
            return
        step = int(published.decode())
        for s in range(self._step + 1, step + 1):
            maybe_inject(self.ctx.cfg.ft.inject_failure, ident.role, ident.role_rank, ident.restart, s)
        self._step = max(self._step, step)

    def serve_until(self, ended) -> Dict[str, Any]:
        self.ctx.set_phase("engine_workers", None)  # the leader's engine drives them
        try:
            ident = self.ctx.ident
            self.follower.serve_until(ended, self._watch, lambda problem: report_dead_worker(
                self.ctx.store, ident.restart, self.seat.engine, problem))
        finally:
            self.follower.shutdown()
        return {"role": "generator", "rank": self.ctx.ident.role_rank, "engine": self.seat.engine, "follower": True}

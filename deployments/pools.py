"""The pools behind one interface: ``Pools.generate(run)`` streams a planned request's deltas
from the pool it was routed to, moves it when the replica serving it dies, and reports what ran.

- plain pool: ``EngineReplica`` without a draft; co-located pool: ``EngineReplica`` with draft +
  target in one process (``handle.options(stream=True).generate(GenerateRequest)``);
- separate topology: ``SeparateLoop`` (Draft and Target deployments, the loop in this process).

Migration (as NVIDIA Dynamo's): if the replica serving a request dies (or, in the separate
topology, the Target), an engine replica prefills prompt + the tokens emitted so far and goes on
from there, so the client's stream continues without a gap or a repeat; the router relayed every
emitted token, so it has them all. At most ``migration_limit`` moves per request.

A pool that lost a replica is down (priced as unavailable: routing and migration skip it) until a
health probe, once a second, gets an answer from it again: Serve holds calls to a pool whose only
replica restarts (~15 s here), and a request routed there would wait that long.

Load: ``active`` counts the requests this router runs in each pool (the batch the cost model
prices), each from its plan to its last delta. When a request ends, its stats teach the
``RouteState`` (acceptance per traffic class, served step times) and the metrics record it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from collections.abc import AsyncIterator

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from autoscaling.routing import POOLS, SPEC_TOPOLOGIES, Pool, PoolLoad
from deployments.channel_executor import ReplicaLost
from deployments.config import AppConfig
from deployments.load_lessons import DECLINE_WINDOW_STEPS
from deployments.messages import Delta, GenerateRequest, Progress, Resume
from deployments.metrics import RouterMetrics
from deployments.planning import Execution
from deployments.route_state import RouteState
from deployments.separate_loop import SeparateLoop

logger = logging.getLogger("ray.serve")

# A replica (or actor) that died or cannot be reached: the request it served can move.
MIGRATABLE = (RayActorError, ActorUnavailableError, ReplicaLost)


class PoolUnavailable(Exception):
    """No replica could finish the request (its migrations ran out): the client may retry (503)."""
HEALTH_PROBE_S = 1.0  # a down pool is asked this often whether it answers again


class Pools:
    def __init__(self, cfg: AppConfig, engines: dict[str, DeploymentHandle], separate: SeparateLoop | None,
                 route_state: RouteState, metrics: RouterMetrics):
        self._cfg = cfg
        self.engines = engines  # "plain" / "colocated" -> EngineReplica handle
        self.separate = separate
        self._route_state = route_state
        self._metrics = metrics
        self.replicas = {Pool.PLAIN: cfg.plain.routing_replicas, Pool.COLOCATED: cfg.colocated.routing_replicas,
                         Pool.SEPARATE: cfg.target_deployment.num_replicas}
        self.active = {p: 0 for p in POOLS}
        self.probing = {p: 0 for p in POOLS}  # of active: exploration probes
        # the integral of all pools' rows over time, to the last change of a count: the mean batch of the
        # whole load over a request's life (what pools that share their cores decode beside it)
        self._row_seconds, self._rows_at = 0.0, time.perf_counter()
        self.engine_messages = 0  # deltas received from engine replicas (tests: coalescing)
        self.migrations = 0
        self.down: set[str] = set()  # pools that lost a replica and have not answered a probe since
        self.lost = dict.fromkeys(POOLS, 0)  # times each pool was found down
        self._probes: set[asyncio.Task] = set()

    @property
    def deployed(self) -> list[str]:
        return [p for p in POOLS if p in self.engines or (p == Pool.SEPARATE and self.separate is not None)]

    def loads(self) -> dict[str, PoolLoad]:
        """Live loads of the pools that can take a request now: the requests this router runs in each."""
        return {p: PoolLoad(self.active[p], 0, self.replicas[p], self._cfg.max_batch_size, probing=self.probing[p])
                for p in self.deployed if p not in self.down}

    def _lost(self, pool: str) -> None:
        """A replica of ``pool`` died: price the pool unavailable until it answers a probe."""
        if pool in self.down:
            return
        self.down.add(pool)
        self.lost[pool] += 1
        task = asyncio.get_running_loop().create_task(self._probe_until_up(pool), context=contextvars.Context())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe_until_up(self, pool: str) -> None:
        while pool in self.down:
            await asyncio.sleep(HEALTH_PROBE_S)
            try:
                if pool == Pool.SEPARATE:
                    await asyncio.wait_for(self.separate.ping(), HEALTH_PROBE_S)
                else:
                    await asyncio.wait_for(self.engines[pool].stats.remote(), HEALTH_PROBE_S)
            except Exception:  # noqa: BLE001, S112 - still restarting
                continue
            self.down.discard(pool)
            logger.info("pool %s answers again", pool)

    def generate(self, run: Execution) -> AsyncIterator[Delta]:
        """Deltas of one request on its pool. The request counts in the pool's load from this call to
        its last delta: the next request's plan sees it also while this one's streamed response has not
        started sending, and no longer once it finished, before the client reads ``[DONE]``. A caller
        whose deltas may never be iterated (a stream the client left) ends the count with ``release``."""
        replicas = max(1, self.replicas[run.pool])
        joined_rows, rows_since = math.ceil((sum(self.active.values()) + 1) / replicas), self._row_clock()
        self._count(run.pool, +1, run.plan.probe)
        run.counted = True
        d = run.plan.decision
        self._metrics.routed(run.pool, d.k, d.regime, run.plan.requested_mode, d.predicted_speedup)
        return self._deltas(run, replicas, joined_rows, rows_since)

    def release(self, run: Execution) -> None:
        """Takes ``run`` out of its pool's load (where it finished: a migrated request moved), once."""
        if run.counted:
            run.counted = False
            self._count(run.pool, -1, run.plan.probe)

    async def _deltas(self, run: Execution, replicas: int, joined_rows: int, rows_since: tuple[float, float]
                      ) -> AsyncIterator[Delta]:
        t0, last, decoded_rows = time.perf_counter(), None, None
        t_first, n_first, n_out, per_token, step_per_token = None, 0, 0, 0.0, 0.0
        taught, window_since = Progress(), rows_since  # of its decode steps, those its declined lessons counted
        try:
            gen = self._migrating(run)
            try:
                async for delta in gen:
                    last = delta
                    n_out += len(delta.token_ids)
                    if t_first is None and n_out:
                        t_first, n_first = time.perf_counter(), n_out
                    if delta.finished:
                        per_token = _decode_time_per_token(t_first, n_first, n_out, delta)
                        step_per_token = _decode_time_per_token(t_first, n_first, n_out, delta, prefill_waits=False)
                        if step_per_token:
                            batch = (delta.stats.mean_decode_batch if delta.stats else 0.0) or run.plan.batch
                            run.realised_speedup = self._route_state.realised_speedup(batch, step_per_token)
                        decoded_rows = self._mean_rows(rows_since) / replicas
                        self.release(run)  # its engine dropped it from the batch
                    elif delta.progress is not None and delta.progress.steps - taught.steps >= DECLINE_WINDOW_STEPS:
                        if self._learn_declined(run, delta.progress.since(taught), window_since):
                            taught, window_since = delta.progress, self._row_clock()
                    yield delta
            finally:
                await gen.aclose()
        finally:
            if decoded_rows is None:
                decoded_rows = self._mean_rows(rows_since) / replicas
            self.release(run)
            try:
                if last is not None and last.stats is not None:
                    self._learn_declined(run, Progress.of(last.stats).since(taught), window_since)
                self._report(run, last, per_token, step_per_token, time.perf_counter() - t0,
                             _time_to_first_token(t0, t_first, n_first, n_out, last), (joined_rows, decoded_rows))
            except Exception:
                logger.exception("learning from a finished request failed")

    def _learn_declined(self, run: Execution, window: Progress, since: tuple[float, float]) -> bool:
        """An auto request routed to speculation teaches what its pool's adaptive K ran plain of ``window``'s
        decode steps (``LoadLessons.learn_declined``), at the batch they ran in: where the pools share their
        cores, the whole load's mean rows since ``since`` (a ``_row_clock`` reading), else its own. Not a
        migrated request: its counts restarted on another replica. Whether it taught."""
        if not (run.plan.params.adaptive_k and run.pool in SPEC_TOPOLOGIES and not run.migrations and window.steps):
            return False
        if self._route_state.shared_compute:
            batch = self._mean_rows(since) / max(1, self.replicas[run.pool])
        else:
            batch = window.batch_rows / window.steps
        self._route_state.lessons.learn_declined(run.pool, batch or run.plan.batch, run.plan.traffic_class, window)
        return True

    def _row_clock(self) -> tuple[float, float]:
        """(row-seconds of all pools so far, now)."""
        now = time.perf_counter()
        return self._row_seconds + sum(self.active.values()) * (now - self._rows_at), now

    def _mean_rows(self, since: tuple[float, float]) -> float:
        """All pools' mean rows since ``since`` (a ``_row_clock`` reading)."""
        row_seconds, now = self._row_clock()
        return (row_seconds - since[0]) / (now - since[1]) if now > since[1] else 0.0

    def _count(self, pool: str, n: int, probe: bool) -> None:
        self._row_seconds, self._rows_at = self._row_clock()
        self.active[pool] += n
        self.probing[pool] += n if probe else 0
        self._metrics.set_running(pool, self.active[pool])

    def _report(self, run: Execution, last: Delta | None, per_token: float, step_per_token: float,
                latency_s: float, ttft_s: float | None, whole_load: tuple[int, float]) -> None:
        """A request ended: the route state learns from its stats, its decode time per token less the
        other requests' prefills it waited for (``step_per_token``; the metrics record ``per_token``, with
        them), and from the rows of all pools when it was routed and on average while it ran
        (``whole_load``)."""
        d = run.plan.decision
        stats = last.stats if last is not None and last.finished else None
        if stats is not None:
            self._route_state.learn(run.pool, run.plan.batch, run.plan.traffic_class, stats, step_per_token,
                                    migrated=run.migrations > 0, whole_load=whole_load, ttft_s=ttft_s)
        if stats is not None and stats.proposed:
            tr = self._route_state.tracker
            self._metrics.acceptance(run.plan.traffic_class, tr.estimate(run.plan.traffic_class),
                                     tr.position_rates(run.plan.traffic_class))
        self._metrics.finished(run.pool, d.k, d.topology, last.finish_reason if stats is not None else "abort",
                               stats, latency_s, d.regime, run.realised_speedup, ttft_s, per_token)

    async def _migrating(self, run: Execution) -> AsyncIterator[Delta]:
        emitted: list[int] = []
        sent_chars = 0
        while True:
            resume = Resume(emitted, sent_chars) if run.migrations else None
            plan = run.plan
            gen = (self.separate.generate(plan.request_id, plan.prompt_ids, plan.params, self._interval(run), resume)
                   if run.pool == Pool.SEPARATE else self._run_engine(run, resume))
            try:
                async for delta in gen:
                    emitted += delta.token_ids
                    sent_chars += len(delta.text)
                    yield delta
                return
            except MIGRATABLE as exc:
                if run.migrations >= self._cfg.migration_limit:
                    raise PoolUnavailable(f"request {run.plan.request_id}: no replica could finish it") from exc
                lost = run.pool
                self._lost(lost)
                run.pool = self._migration_pool(lost)
                run.migrations += 1
                self.migrations += 1
                self._count(lost, -1, run.plan.probe)
                self._count(run.pool, +1, run.plan.probe)
                self._metrics.migrations.inc(tags={"pool": lost})
                logger.warning("request %s: %s replica lost after %d tokens; continuing on %s", run.plan.request_id,
                               lost, len(emitted), run.pool, exc_info=True)
            finally:
                await gen.aclose()

    def _migration_pool(self, lost: Pool) -> Pool:
        """Where a request goes when the replica serving it died: the same engine pool if it has
        other replicas, else another engine pool (the plain pool first: it needs no draft)."""
        if lost != Pool.SEPARATE and self.replicas.get(lost, 1) > 1:
            return lost
        others = [p for p in (Pool.PLAIN, Pool.COLOCATED) if p in self.engines and p != lost]
        up = [p for p in others if p not in self.down]
        return (up or others or [lost])[0]

    def _interval(self, run: Execution) -> float | None:
        """How often a request's deltas go out: per ``stream_interval_s`` streamed, once otherwise."""
        return self._cfg.stream_interval_s if run.plan.stream else None

    async def _run_engine(self, run: Execution, resume: Resume | None) -> AsyncIterator[Delta]:
        params = run.plan.params_for(run.pool)
        # An adaptive request carries the router's drift: the replica prices its steps with it (one view).
        drift = self._route_state.drift if params.adaptive_k else None
        req = GenerateRequest(run.plan.request_id, run.plan.prompt_ids, params, self._interval(run), resume, drift)
        # Serve's gRPC transport (what RAY_SERVE_THROUGHPUT_OPTIMIZED turns on for every handle):
        # a streamed call costs half of the actor transport's here (BENCHMARKS.md, "Serving overhead").
        # Nothing on this path needs an object ref.
        responses = self.engines[run.pool].options(stream=True, _by_reference=False).generate.remote(req)
        finished = False
        try:
            async for d in responses:
                self.engine_messages += 1
                finished = d.finished
                yield d
        finally:
            if not finished:
                responses.cancel()  # the replica's generator exits: the engine aborts and frees slots


def _time_to_first_token(t0: float, t_first: float | None, n_first: int, n_out: int,
                         last: Delta | None) -> float | None:
    """Seconds from the hand-off to the pool to the first token, by the router's clock where the
    tokens came in several messages, else (one message) by the replica's."""
    if t_first is not None and n_out > n_first:
        return t_first - t0
    if last is not None and last.stats is not None and last.stats.output_tokens:
        return last.stats.first_token_s
    return None


def _decode_time_per_token(t_first: float | None, n_first: int, n_out: int, last: Delta,
                           prefill_waits: bool = True) -> float:
    """Seconds per output token after the first, by the router's clock where the tokens came in
    several messages, else (one message: a non-streamed request) by the replica's. Without
    ``prefill_waits``: less the other requests' prefills its engine ran while it decoded
    (``RequestStats.prefill_wait_s``), what routing learns step costs from. A prefill is a request's
    cost whichever pool serves it, but it lands in the decode of the rows beside it only where they
    finish at different steps: in a closed loop at c=8, plain rows finish together and their successors'
    prefills fell in their TTFT (3% of their decode time went outside their steps), co-located rows
    finish apart and the prefills fell in their decode (24%), which priced co-located steps 1.43x their
    calibration against plain's 1.00 (BENCHMARKS.md, "Prefills in the decode of the rows beside them")."""
    waits = 0.0 if prefill_waits or last.stats is None else last.stats.prefill_wait_s
    if t_first is not None and n_out > n_first:
        return max(0.0, time.perf_counter() - t_first - waits) / (n_out - n_first)
    s = last.stats
    if s is not None and s.output_tokens > 1:
        return max(0.0, s.latency_s - s.first_token_s - waits) / (s.output_tokens - 1)
    return 0.0

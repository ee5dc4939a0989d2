"""The HTTP ingress: serves the OpenAI API by composing the serving layer's parts.

A request's path, top-down: the API layer (``api.py``: schemas, errors, request ids, limits) ->
admission (``admission.py``: a bounded number in flight, 503 beyond) -> tokenize and plan
(``planning.py``: limits, then the routing decision of ``regimes.RouteState`` over the pools'
live loads, the step costs and the acceptance tracker) -> run on its pool (``pools.py``: the
engine pools, or the separate topology's loop in ``separate_loop.py``; migration when a replica
dies) -> the OpenAI body or SSE stream (``responses.py``). When it ends, its stats teach the route
state and the metrics. ``GET /v1/regimes`` shows the live regime map.

mode=auto speculation in the co-located pool runs with adaptive K (the replica re-chooses K <= the
routed K every step, down to 0 when acceptance collapses); explicit K stays fixed. Step costs: the
co-located replicas calibrate at start-up (or load ``calibration_file``); the router fetches them
once the app is RUNNING and routes on a prior table (docs/ARCHITECTURE.md, Facts) until then.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from ray import serve
from ray.serve.handle import DeploymentHandle

from autoscaling.routing import Pool
from deployments import api, operators, responses, schemas
from deployments.admission import Admission, AdmittedStreamingResponse
from deployments.api import APIError, app
from deployments.config import AppConfig
from deployments.metrics import RouterMetrics
from deployments.planning import Execution, Prompts, check_supported, plan_request
from deployments.pools import Pools
from deployments.regimes_map import regimes_map
from deployments.route_state import RouteState
from deployments.separate_loop import SeparateLoop
from specdec_core.acceptance import AcceptanceTracker

logger = logging.getLogger("ray.serve")

COSTS_RETRY_S = 10.0  # a failed fetch of the step costs is retried at most this often


@serve.ingress(app)
class Router:
    def __init__(
        self,
        config: dict,
        plain: DeploymentHandle | None = None,
        colocated: DeploymentHandle | None = None,
        draft: DeploymentHandle | None = None,
        target: DeploymentHandle | None = None,
    ):
        self.cfg = cfg = AppConfig(**config)
        self.prompts = Prompts(cfg)
        self.metrics = RouterMetrics(max_domain_labels=1 + cfg.max_traffic_classes + cfg.traffic_class_buckets)
        self.route_state = RouteState.from_config(cfg, self.prompts.max_model_len)
        self.admission = Admission(cfg.max_inflight_requests, self.metrics)
        engines = {name: h for name, h in ((Pool.PLAIN, plain), (Pool.COLOCATED, colocated)) if h is not None}
        separate = None if target is None else SeparateLoop(
            draft, target, self.prompts.tokenizer, self.prompts.eos_ids, self.prompts.max_model_len,
            cfg.step_timeout_s, self.route_state.separate_adaptive(AcceptanceTracker(
                cfg.acceptance_prior, cfg.acceptance_prior_weight, cfg.acceptance_half_life_tokens)),
            self.route_state.overlaps, self.metrics)
        self.pools = Pools(cfg, engines, separate, self.route_state, self.metrics)
        self._draft, self._target = draft, target
        self._created = schemas.now()
        self._ready_at: float | None = None  # when Serve first reported the whole app RUNNING
        self._ready_checked = 0.0
        self._status_check: asyncio.Task | None = None  # a serve.status() question in flight
        self._costs_retry_at = 0.0
        self._costs_task: asyncio.Task | None = None  # the step costs' fetch, in flight or done
        self._app_name = serve.get_replica_context().app_name
        api.configure(cfg.max_body_bytes, cfg.max_header_bytes, cfg.api_key)
        logger.info("Router ready: pools=%s separate=%s max_len=%d", list(engines), target is not None,
                    self.prompts.max_model_len)

    # ---- HTTP endpoints ----------------------------------------------------------------------------

    @app.get("/health")
    async def health(self):
        """200 once every deployment of the app is RUNNING (replicas started, co-located ones
        calibrated), 503 before: a client that waits for 200 never queues behind start-up."""
        if not await self._ready():
            raise APIError(503, "the service is starting: its model replicas are not all running yet",
                           "server_error", None, "starting")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict:
        if not await self._ready():
            raise APIError(503, "the service is starting", "server_error", None, "starting")
        return {"object": "list", "data": [{"id": self.cfg.model_name, "object": "model", "created": self._created,
                                            "owned_by": "specdec-serve", "max_model_len": self.prompts.max_model_len}]}

    @app.get("/v1/regimes")
    async def regimes(self) -> dict:
        """The live regime map (README: "GET /v1/regimes")."""
        await self._ensure_costs()
        return regimes_map(self.route_state, self.pools.loads())

    @app.get("/v1/stats")
    async def http_stats(self) -> dict:
        return await self.pool_stats()

    @app.post("/v1/completions")
    async def completions(self, body: schemas.CompletionRequest):
        await self._check_started()
        self._check_request(body)
        ids = await self.prompts.completion_ids(body.prompt)
        return await self._serve(body, ids, body.max_tokens, self.cfg.default_max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: schemas.ChatCompletionRequest):
        await self._check_started()
        self._check_request(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await self.prompts.chat_ids(messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await self._serve(body, ids, max_tokens, self.cfg.chat_default_max_tokens, chat=True)

    # ---- one request -----------------------------------------------------------------------------------

    async def _check_started(self) -> None:
        """503 until every deployment runs: a request sent while a co-located replica still calibrates
        would wait for it (measured: 58 s for an auto request routed there by the prior table), as
        vLLM, which does not listen before it is ready, never lets one."""
        if not await self._ready():
            self.metrics.rejected.inc(tags={"status": "503"})
            raise APIError(503, "the service is starting: its model replicas are not all running yet; retry "
                           "when GET /health answers 200", "server_error", None, "starting")

    def _check_request(self, body) -> None:
        """What can be refused before any work: overload (503 at once), unsupported OpenAI fields."""
        self.admission.check()
        check_supported(body)

    async def _serve(self, body, ids: list[int], max_tokens: int | None, default_max: int, chat: bool):
        if body.speculation is None or body.speculation.mode == "auto":
            await self._ensure_costs()
        self.admission.check()  # again: tokenizing and fetching costs awaited
        try:
            plan = plan_request(body, ids, max_tokens, default_max, chat, api.current_request_id(), self.cfg,
                                self.prompts, self.route_state, self.pools.loads(), self.pools.down)
        except APIError as exc:
            self.metrics.rejected.inc(tags={"status": str(exc.status)})
            raise
        run = Execution.of(plan)
        # a stream the client leaves before its body starts never runs its deltas: the slot's release
        # (also then) takes the request out of its pool's load too
        slot = self.admission.admit(on_release=lambda: self.pools.release(run))
        deltas = self.pools.generate(run)
        if body.stream:
            events = responses.stream(run, deltas, self.route_state.costs_source, slot.release)
            return AdmittedStreamingResponse(events, slot, media_type="text/event-stream")
        try:
            return await responses.complete(run, deltas, self.route_state.costs_source)
        finally:
            slot.release()

    # ---- readiness and step costs ------------------------------------------------------------------------

    async def _ready(self) -> bool:
        """Whether Serve reports this app RUNNING; asked at most every 0.5 s until it first does. Requests
        that arrive while the question is out wait for its answer (not a 503 of their own)."""
        if self._ready_at is None:
            if self._status_check is None and time.monotonic() - self._ready_checked > 0.5:
                self._ready_checked = time.monotonic()
                self._status_check = asyncio.get_running_loop().create_task(self._check_status())
            if self._status_check is not None:
                await asyncio.shield(self._status_check)
        return self._ready_at is not None

    async def _check_status(self) -> None:
        try:
            status = await asyncio.to_thread(serve.status)
            app_status = status.applications.get(self._app_name)
            if app_status is not None and app_status.status == "RUNNING":
                self._ready_at = time.monotonic()
                self._fetch_costs()  # now, not on the first auto request
        except Exception:
            logger.warning("serve.status() failed", exc_info=True)
        finally:
            self._status_check = None

    async def _ensure_costs(self) -> None:
        """The co-located replicas' calibrated step costs, fetched once (until then: the prior table). A
        request that arrives while the fetch is out waits for it: the app's first auto request, sent the
        moment it is ready, would otherwise route on the prior table."""
        fetch = self._fetch_costs()
        if fetch is not None:
            await asyncio.shield(fetch)

    def _fetch_costs(self) -> asyncio.Task | None:
        """The fetch in flight, or a new one where it is due (None: fetched, or retried too recently)."""
        if self._costs_task is not None and not self._costs_task.done():
            return self._costs_task
        colocated = self.pools.engines.get(Pool.COLOCATED)
        if self.route_state.calibrated or colocated is None or time.monotonic() < self._costs_retry_at:
            return None
        self._costs_retry_at = time.monotonic() + COSTS_RETRY_S
        self._costs_task = asyncio.get_running_loop().create_task(self._costs_from(colocated))
        return self._costs_task

    async def _costs_from(self, colocated: DeploymentHandle) -> None:
        try:
            got = await asyncio.wait_for(colocated.costs.remote(), 10.0)
        except Exception:
            logger.warning("step costs not available yet; routing on the prior cost table", exc_info=True)
            return
        if got is not None:
            self.route_state.set_costs(got.costs, got.source, got.sampled)
            logger.info("routing on step costs %s", got.source)

    # ---- handle-only methods (tests, operators) ---------------------------------------------------------

    async def pool_stats(self) -> dict:
        """stats() of every deployment's replicas, and the router's own counters."""
        p, sep = self.pools, self.pools.separate
        out: dict = {"router": {
            "inflight": self.admission.inflight, "active": dict(p.active), "engine_messages": p.engine_messages,
            "migrations": p.migrations, "down": sorted(p.down), "pools_lost": dict(p.lost),
            "background": len(sep.background) if sep else 0, "separate_aborted": sep.aborted if sep else 0,
            "draft_failures": sep.draft_failures if sep else 0, "separate_steps": sep.steps if sep else 0,
            "separate_overlap": dataclasses.asdict(sep.overlap) if sep else None}}
        for name, handle in p.engines.items():
            out[name] = await operators.engine_pool_stats(handle, p.replicas[name])
        if sep is not None:
            out["draft"] = await operators.pinned_stats(self._draft, self.cfg.draft_deployment.num_replicas)
            out["target"] = await operators.pinned_stats(self._target, self.cfg.target_deployment.num_replicas)
        return out

    async def probe_sessions(self, deployment: str, session_ids: list[str], fresh_ids: bool = True,
                             timeout_s: float = 30.0) -> dict:
        handle = {"draft": self._draft, "target": self._target}[deployment]
        return await operators.probe_sessions(handle, session_ids, fresh_ids, timeout_s)

"""The HTTP ingress: OpenAI-compatible API, routing, and the separate topology's step loop.

Per request: validate -> tokenize (chat: the tokenizer's chat template, or the fallback below) ->
``choose_route`` (``autoscaling.routing.route`` over live pool loads, the calibrated cost model and
the acceptance tracker, glued by ``deployments/regimes.py``) -> run on one of three paths ->
detokenize / stream -> the finished request's acceptance stats feed the tracker.
``GET /v1/regimes`` shows the live regime map.

mode=auto speculation in the co-located pool runs with adaptive K (the replica re-chooses K <= the
routed K every step, down to 0 when acceptance collapses); explicit K stays fixed. Step costs: the
co-located replicas calibrate at start-up (or load ``calibration_file``); the router fetches them on
the first auto request and routes on a prior table (docs/ARCHITECTURE.md, Facts) until then.

- plain pool: ``EngineReplica`` without a draft (``handle.options(stream=True).generate``).
- co-located pool: ``EngineReplica`` with draft + target in one process, same call.
- separate topology: this router runs the speculative loop. Per step it calls
  ``Draft.propose(session, history, K, sampling)`` and passes the returned DeploymentResponse,
  unawaited, into ``Target.verify(session, history, proposal, sampling)``; it appends the outcome
  to the request's history, which it owns (the replicas hold only soft KV state keyed by session
  and reconcile against the history they receive). Both handles are pinned to the session's
  replicas by ``SessionAffinityRouter``. A failed propose degrades the rest of the request to plain
  verify steps; the request is never lost. ``release`` goes to both sides when the request ends,
  whether it finished, failed or its client went away.

Chat fallback template (tokenizers without ``chat_template``): every message is rendered as
``"<role>: <content>\\n"`` and the prompt ends with ``"assistant:"``.

Overload: at most ``max_inflight_requests`` requests are served at once; more get 503 at once
(OpenAI error body) instead of an unbounded backlog.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from autoscaling.routing import PoolLoad, RequestFeatures, RoutingDecision, RoutingError, RoutingThresholds
from deployments import api, schemas
from deployments.api import APIError, app, bad_request, internal_error_message, sse_event
from deployments.config import AppConfig, model_label
from deployments.metrics import RouterMetrics
from deployments.regimes import POOLS, Route, RouteState, objective_of
from deployments.session_router import pinned_gather
from specdec_core import RequestStats, SamplingParams
from specdec_core.acceptance import AcceptanceTracker, TrafficClass
from specdec_core.costmodel import StepCosts
from specdec_core.request import RequestState, eos_token_ids

logger = logging.getLogger("ray.serve")


class ReplicaLost(Exception):
    """A replica did not answer in time: presumed dead or restarting."""


# A replica (or actor) that died or cannot be reached: the request it served can move.
MIGRATABLE = (RayActorError, ActorUnavailableError, ReplicaLost)
DRAFT_RETRY_S = 5.0  # after a draft failure, separate requests decode plain this long before trying it again
RETRY_AFTER_S = 15  # a 503 for lost replicas: Serve restarts a replica in ~13-17 s here

# ---- routing decision ---------------------------------------------------------------------------


def choose_route(state: RouteState, features: RequestFeatures, loads: Mapping[str, PoolLoad]) -> Route:
    """Where this request runs, with which K, and why: ``autoscaling.routing.route`` over the live
    loads of the deployed pools (``loads`` holds only those), the cost models from the calibrated
    step costs and the tracker's acceptance estimate for the request's traffic class
    (``RouteState`` builds the context). Explicit fields win; mode "auto" speculates where the
    cost model predicts a speedup at the batch the request joins. Raises ``RoutingError`` (400)."""
    return state.decide(features, loads)


# ---- the separate topology's request state ----------------------------------------------------------


class SeparateRequest(RequestState):
    """One separate-topology request: the same history, stopping rules and detokenization as the
    engine's requests (``specdec_core.request``), reported in the engine replicas' delta format."""

    def delta(self) -> dict:
        out = self.output()
        return {"token_ids": out.new_token_ids, "text": out.new_text, "finished": out.finished,
                "finish_reason": out.finish_reason, "stats": out.stats.as_dict() if out.finished else None}


class _Admission:
    """One in-flight slot of the router's bounded queue; released exactly once."""

    def __init__(self, router: Router):
        self._router = router
        self._released = False
        router._inflight += 1
        router.metrics.inflight.set(router._inflight)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._router._inflight -= 1
            self._router.metrics.inflight.set(self._router._inflight)

    def __del__(self):  # a stream whose body never started still gives its slot back
        self.release()


class _StreamingResponse(StreamingResponse):
    """Releases the admission when the ASGI call ends, also when the client left before the body
    generator ever started (then the generator's own ``finally`` never runs)."""

    def __init__(self, content, admission: _Admission, **kwargs):
        super().__init__(content, **kwargs)
        self._admission = admission

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._admission.release()
            await self.body_iterator.aclose()


@dataclass
class _Plan:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    decision: RoutingDecision
    model: str
    chat: bool
    return_token_ids: bool
    include_usage: bool
    pool: str = "plain"  # the deployed pool that runs it (decision.pool, or a spec pool for plain decoding)
    batch: int = 1  # per-replica batch it joined
    adaptive: bool = False  # auto-mode speculation: the replica re-chooses K <= decision.k per step
    traffic_class: TrafficClass | None = None
    requested_mode: str = "auto"
    stream: bool = False  # the client streams: the replica sends tokens as they come, else one message
    migrations: int = 0  # times the request moved because the replica serving it died
    realised_speedup: float | None = field(default=None)


# Helpers stay above the ingress class: @serve.ingress pickles the FastAPI app (and the globals its
# endpoints reference) when the class is decorated, so names defined below it would be missing.


async def _failed(response) -> bool:
    try:
        await response
    except Exception:  # noqa: BLE001
        return True
    return False


# ---- the ingress deployment ------------------------------------------------------------------------------


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
        from transformers import AutoConfig, GenerationConfig

        from specdec_core.runner import load_tokenizer

        self.cfg = AppConfig(**config)
        self._pools: dict[str, DeploymentHandle] = {}
        if plain is not None:
            self._pools["plain"] = plain
        if colocated is not None:
            self._pools["colocated"] = colocated
        self._draft, self._target = draft, target
        self._replicas = {"plain": self.cfg.plain.routing_replicas, "colocated": self.cfg.colocated.routing_replicas,
                          "separate": self.cfg.target_deployment.num_replicas}
        self.tokenizer = load_tokenizer(self.cfg.target, self.cfg.trust_remote_code)
        model_cfg = AutoConfig.from_pretrained(self.cfg.target, trust_remote_code=self.cfg.trust_remote_code)
        self.vocab_size = int(model_cfg.vocab_size)
        self.max_model_len = min(self.cfg.max_model_len,
                                 getattr(model_cfg, "max_position_embeddings", None) or self.cfg.max_model_len)
        try:
            gen_cfg = GenerationConfig.from_pretrained(self.cfg.target)
        except Exception:  # noqa: BLE001 - checkpoints without generation_config.json
            gen_cfg = None
        self.eos_ids = eos_token_ids(self.tokenizer, gen_cfg)
        tracker = AcceptanceTracker(self.cfg.acceptance_prior, self.cfg.acceptance_prior_weight,
                                    self.cfg.acceptance_half_life_tokens)
        self.route_state = RouteState(model_label(self.cfg.draft), tracker, self.cfg.k_max, self.cfg.default_k,
                                      self.max_model_len, self.cfg.separate_hop_overhead_s,
                                      RoutingThresholds(margin=self.cfg.route_margin))
        self._costs_retry_at = 0.0
        self._inflight = 0
        self._active = {p: 0 for p in POOLS}
        self._separate_aborted = 0
        self._engine_messages = 0  # deltas received from engine replicas (tests: coalescing)
        self._migrations = 0
        self._draft_down_until = 0.0  # after a draft failure, separate requests skip speculation until then
        self._draft_failures = 0
        self._background: set[asyncio.Task] = set()
        self._created = schemas.now()
        self._ready_at: float | None = None  # when Serve first reported the whole app RUNNING
        self._ready_checked = 0.0
        self._costs_task: asyncio.Task | None = None
        self._app_name = serve.get_replica_context().app_name
        # The tokenizer runs off the event loop, in one thread: a fast tokenizer must not be used
        # from two threads at once ("Already borrowed").
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        api.configure(self.cfg.max_body_bytes, self.cfg.max_header_bytes, self.cfg.api_key)
        self.metrics = RouterMetrics()
        logger.info("Router ready: pools=%s separate=%s max_len=%d", list(self._pools), self._target is not None,
                    self.max_model_len)

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
                                            "owned_by": "specdec-serve", "max_model_len": self.max_model_len}]}

    @app.get("/v1/regimes")
    async def regimes(self) -> dict:
        """The live regime map (README: "GET /v1/regimes")."""
        await self._ensure_costs()
        return self.route_state.regimes(self._loads())

    @app.get("/v1/stats")
    async def http_stats(self) -> dict:
        return await self.pool_stats()

    @app.post("/v1/completions")
    async def completions(self, body: schemas.CompletionRequest):
        self._check_request(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await self._off_loop(self._encode, prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise bad_request(f"prompt token ids must lie in [0, {self.vocab_size})", "prompt",
                                  "invalid_token_id")
        return await self._serve(body, ids, body.max_tokens, self.cfg.default_max_tokens, chat=False,
                                 request_id=api.current_request_id())

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: schemas.ChatCompletionRequest):
        self._check_request(body)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        ids = await self._off_loop(self._encode_chat, messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await self._serve(body, ids, max_tokens, self.cfg.chat_default_max_tokens, chat=True,
                                 request_id=api.current_request_id())

    def _check_request(self, body) -> None:
        """What can be refused before any work: overload (503 at once), unsupported OpenAI fields."""
        self._check_capacity()
        field = body.unsupported_field()
        if field is not None:
            raise bad_request(f"{field} is not supported by this server", field, "unsupported_parameter")
        if body.n != 1:
            raise bad_request("only n=1 is supported", "n")

    def _check_capacity(self) -> None:
        if self._inflight >= self.cfg.max_inflight_requests:
            self.metrics.rejected.inc(tags={"status": "503"})
            raise APIError(503, f"server overloaded: {self._inflight} requests in flight "
                                f"(max_inflight_requests={self.cfg.max_inflight_requests}); retry later",
                           "server_error", None, "overloaded")

    async def _off_loop(self, fn, arg):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, fn, arg)

    async def _ready(self) -> bool:
        """Whether Serve reports this app RUNNING; asked at most every 0.5 s until it first does."""
        if self._ready_at is None and time.monotonic() - self._ready_checked > 0.5:
            self._ready_checked = time.monotonic()
            try:
                status = await asyncio.to_thread(serve.status)
                app_status = status.applications.get(self._app_name)
                if app_status is not None and app_status.status == "RUNNING":
                    self._ready_at = time.monotonic()
                    # fetch the step costs now, not on the first auto request
                    self._costs_task = asyncio.get_running_loop().create_task(self._ensure_costs())
            except Exception:
                logger.warning("serve.status() failed", exc_info=True)
        return self._ready_at is not None

    # ---- handle-only methods (tests, operators) ---------------------------------------------------------

    async def pool_stats(self) -> dict:
        """stats() of every deployment's replicas. Engine pools: one call per replica; Draft/Target:
        one pinned call per replica, found by probing session ids (affinity decides placement)."""
        out: dict = {"router": {"inflight": self._inflight, "active": dict(self._active),
                                "background": len(self._background), "separate_aborted": self._separate_aborted,
                                "draft_failures": self._draft_failures,
                                "engine_messages": self._engine_messages, "migrations": self._migrations}}
        for name, handle in self._pools.items():
            # Engine pools use Serve's default routing: sample until every replica has answered once
            # (exact for one replica; with n replicas, 4n calls miss one with probability ~n e^-4).
            n = self._replicas[name]
            seen: dict[str, dict] = {}
            for _ in range(1 if n <= 1 else 4 * n):
                st = await handle.stats.remote()
                seen.setdefault(st["replica"], st)
                if len(seen) >= n:
                    break
            out[name] = list(seen.values())
        if self._target is not None:
            for name, handle, n in (("draft", self._draft, self.cfg.draft_deployment.num_replicas),
                                    ("target", self._target, self.cfg.target_deployment.num_replicas)):
                probes = [f"__stats-probe-{i}" for i in range(max(8, 8 * n))]
                placed = await pinned_gather(*(lambda s=s, h=handle: h.options(session_id=s).where.remote(s)
                                               for s in probes))
                one_per_replica = {p["replica"]: s for s, p in zip(probes, placed)}
                out[name] = await pinned_gather(*(lambda s=s, h=handle: h.options(session_id=s).stats.remote()
                                                  for s in one_per_replica.values()))
        return out

    async def probe_sessions(self, deployment: str, session_ids: list[str], fresh_ids: bool = True,
                             timeout_s: float = 30.0) -> dict:
        """Concurrent pinned ``where`` calls from inside this one request (the 2.60 gather bug's
        shape). -> {"placement": [{"replica", "holds"}...]} or {"timed_out": True}."""
        handle = {"draft": self._draft, "target": self._target}[deployment]
        calls = [lambda s=s: handle.options(session_id=s).where.remote(s) for s in session_ids]
        try:
            placement = await asyncio.wait_for(pinned_gather(*calls, fresh_ids=fresh_ids), timeout_s)
        except asyncio.TimeoutError:
            return {"timed_out": True}
        return {"placement": placement}

    # ---- request handling -----------------------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self._encode(text)

    def _plan(self, body, ids: list[int], max_tokens: int | None, default_max: int, chat: bool,
              request_id: str) -> _Plan:
        if body.model is not None and body.model != self.cfg.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {self.cfg.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")
        if not ids:
            raise bad_request("the prompt is empty", "messages" if chat else "prompt")
        stops = body.stop_list()
        if len(stops) > 4:
            raise bad_request("at most 4 stop sequences", "stop")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise APIError(413, f"the prompt has {len(ids)} tokens; the context limit is {limit} tokens "
                                f"(prompt + at least one output token)", "invalid_request_error",
                           "messages" if chat else "prompt", "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max, limit - len(ids))
        elif len(ids) + max_tokens > limit:
            raise bad_request(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context limit "
                              f"of {limit} tokens", "max_tokens", "context_length_exceeded")
        spec = body.speculation or schemas.SpeculationOptions()
        cls = self.route_state.traffic_class(body.temperature, body.user)
        features = self.route_state.features(
            temperature=body.temperature, top_p=body.top_p, max_tokens=max_tokens, prompt_tokens=len(ids),
            mode=spec.mode, k=spec.num_speculative_tokens, topology=spec.topology,
            objective=objective_of(spec.objective, body.service_tier), cls=cls)
        try:
            route = choose_route(self.route_state, features, self._loads())
        except RoutingError as exc:
            raise bad_request(str(exc), "speculation") from None
        decision = route.decision
        params = SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k, seed=body.seed, stop=tuple(stops), ignore_eos=body.ignore_eos,
                                num_speculative_tokens=decision.k, adaptive_k=route.adaptive,
                                domain=body.user or "default")
        try:
            params.validate()  # the engine's own admission check, so no request reaches a step it would fail
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        prefix = "chatcmpl" if chat else "cmpl"
        return _Plan(f"{prefix}-{request_id}", ids, params.normalized(self.vocab_size), decision, self.cfg.model_name, chat,
                     body.return_token_ids, bool(body.stream_options and body.stream_options.include_usage),
                     pool=route.pool, batch=route.batch, adaptive=route.adaptive, traffic_class=cls,
                     requested_mode=spec.mode, stream=body.stream)

    def _loads(self) -> dict[str, PoolLoad]:
        """Live loads of the deployed pools: the requests this router runs in each."""
        return {p: PoolLoad(self._active[p], 0, self._replicas[p], self.cfg.max_batch_size)
                for p in POOLS if p in self._pools or (p == "separate" and self._target is not None)}

    async def _ensure_costs(self) -> None:
        """Fetch the co-located replicas' calibrated step costs once (until then: the prior table);
        a failed fetch is retried at most every 10 s."""
        if self.route_state.calibrated or "colocated" not in self._pools or time.monotonic() < self._costs_retry_at:
            return
        self._costs_retry_at = time.monotonic() + 10.0
        try:
            got = await asyncio.wait_for(self._pools["colocated"].costs.remote(), 10.0)
        except Exception:
            logger.warning("step costs not available yet; routing on the prior cost table", exc_info=True)
            return
        if got:
            self.route_state.set_costs(StepCosts.from_dict(got["costs"]), got["source"])
            logger.info("routing on step costs %s", got["source"])

    async def _serve(self, body, ids, max_tokens, default_max, chat: bool, request_id: str):
        if body.speculation is None or body.speculation.mode == "auto":
            await self._ensure_costs()
        self._check_capacity()  # again: tokenizing and fetching costs awaited
        try:
            plan = self._plan(body, ids, max_tokens, default_max, chat, request_id)
        except APIError as exc:
            self.metrics.rejected.inc(tags={"status": str(exc.status)})
            raise
        admission = _Admission(self)
        if body.stream:
            return _StreamingResponse(self._stream(plan, admission), admission, media_type="text/event-stream")
        try:
            return await self._complete(plan)
        finally:
            admission.release()

    async def _complete(self, plan: _Plan) -> dict:
        text, token_ids, last = [], [], None
        deltas = self._execute(plan)
        try:
            async for d in deltas:
                text.append(d["text"])
                token_ids.extend(d["token_ids"])
                last = d
        except APIError:
            raise
        except MIGRATABLE:
            logger.exception("request %s: no replica could finish it", plan.request_id)
            raise APIError(503, f"no model replica can serve the request now (request id {plan.request_id}); "
                                "retry later", "server_error", None, "unavailable",
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        except Exception:
            logger.exception("request %s failed", plan.request_id)
            raise APIError(500, internal_error_message(plan.request_id), "server_error") from None
        finally:
            await deltas.aclose()
        stats = last["stats"] if last and last["stats"] else RequestStats().as_dict()
        build = schemas.chat_body if plan.chat else schemas.completion_body
        return build(plan.request_id, schemas.now(), plan.model, "".join(text), last["finish_reason"] if last else None,
                     schemas.usage(len(plan.prompt_ids), len(token_ids)), self._speculation(plan, stats),
                     token_ids if plan.return_token_ids else None)

    async def _stream(self, plan: _Plan, admission: _Admission) -> AsyncIterator[str]:
        """SSE events, one write per delta: every write is a message from this replica to the proxy,
        so the chat role chunk rides with the first delta and the last chunk, the usage chunk and
        [DONE] go out together."""
        created = schemas.now()
        rid, model = plan.request_id, plan.model
        n_out, done = 0, False
        pending = [sse_event(schemas.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}))
                   ] if plan.chat else []
        deltas = self._execute(plan)
        try:
            async for d in deltas:
                n_out += len(d["token_ids"])
                events, pending = pending + self._delta_events(plan, d, created, n_out), []
                if d["finished"]:
                    events.append("data: [DONE]\n\n")
                    done = True
                if events:
                    yield "".join(events)
            if not done:
                yield "".join(pending) + "data: [DONE]\n\n"
        except Exception:
            logger.exception("stream %s failed", rid)
            yield sse_event(schemas.error_body(internal_error_message(rid), "server_error")) + "data: [DONE]\n\n"
        finally:
            admission.release()  # first: the await below can be interrupted by a second cancellation
            await deltas.aclose()

    def _delta_events(self, plan: _Plan, d: dict, created: int, n_out: int) -> list[str]:
        rid, model = plan.request_id, plan.model
        ids = d["token_ids"] if plan.return_token_ids else None
        if not d["finished"]:
            if not (d["text"] or d["token_ids"]):
                return []
            if plan.chat:
                return [sse_event(schemas.chat_chunk(rid, created, model, {"content": d["text"]}, None, ids))]
            return [sse_event(schemas.completion_chunk(rid, created, model, d["text"], None, ids))]
        spec = self._speculation(plan, d["stats"])
        if plan.chat:
            chunk = schemas.chat_chunk(rid, created, model, {"content": d["text"]} if d["text"] else {},
                                       d["finish_reason"], ids)
        else:
            chunk = schemas.completion_chunk(rid, created, model, d["text"], d["finish_reason"], ids)
        chunk["speculation"] = spec
        events = [sse_event(chunk)]
        if plan.include_usage:
            events.append(sse_event({"id": rid, "object": chunk["object"], "created": created, "model": model,
                                     "choices": [], "usage": schemas.usage(len(plan.prompt_ids), n_out),
                                     "speculation": spec}))
        return events

    def _speculation(self, plan: _Plan, stats: dict) -> dict:
        d = plan.decision
        return {
            "mode": "speculative" if d.k > 0 else "plain",
            "topology": d.topology,
            "num_speculative_tokens": d.k,
            "proposed_tokens": stats["proposed_tokens"],
            "accepted_tokens": stats["accepted_tokens"],
            "acceptance_rate": stats["acceptance_rate"],
            "mean_acceptance_length": stats["mean_acceptance_length"],
            "verify_steps": stats["verify_steps"],
            "plain_steps": stats["plain_steps"],  # decode steps without draft tokens (adaptive K = 0)
            "pool": plan.pool,
            "adaptive_k": plan.adaptive,
            "regime": d.regime,
            "predicted_speedup": d.predicted_speedup,
            "realised_speedup": plan.realised_speedup,
            "batch": plan.batch,
            "route_reason": d.reason,
            "costs_source": self.route_state.costs_source,
            "migrations": plan.migrations,
        }

    async def _execute(self, plan: _Plan) -> AsyncIterator[dict]:
        """Deltas of one request on the chosen path; the pool's load counter covers its lifetime.
        At the end: the acceptance tracker learns from its stats, the metrics record it."""
        pool, d = plan.pool, plan.decision
        self._active[pool] += 1
        self.metrics.set_running(pool, self._active[pool])
        self.metrics.routed(pool, d.k, d.regime, plan.requested_mode, d.predicted_speedup)
        t0, last = time.perf_counter(), None
        t_first, n_first, n_out, per_token = None, 0, 0, 0.0
        try:
            gen = self._migrating(plan)
            try:
                async for delta in gen:
                    last = delta
                    n_out += len(delta["token_ids"])
                    if t_first is None and n_out:
                        t_first, n_first = time.perf_counter(), n_out
                    if delta["finished"]:
                        per_token = self._decode_time_per_token(t_first, n_first, n_out, delta["stats"])
                        if per_token:
                            plan.realised_speedup = self.route_state.realised_speedup(plan.batch, per_token)
                    yield delta
            finally:
                await gen.aclose()
        finally:
            pool = plan.pool  # where it finished: a migrated request moved
            self._active[pool] -= 1
            finished = last is not None and last["finished"]
            try:
                self.metrics.set_running(pool, self._active[pool])
                stats = last["stats"] if finished and last["stats"] else {}
                if stats and per_token and not plan.migrations:  # a re-prefill is no step time
                    self.route_state.observe_timing(pool, plan.batch, stats, per_token)
                if stats.get("proposed_tokens") and plan.traffic_class is not None:
                    self.route_state.observe(plan.traffic_class, stats)
                    tr = self.route_state.tracker
                    self.metrics.acceptance(plan.traffic_class, tr.estimate(plan.traffic_class),
                                            tr.position_rates(plan.traffic_class))
                self.metrics.finished(pool, d.k, d.topology, last["finish_reason"] if finished else "abort",
                                      stats, time.perf_counter() - t0, d.regime, plan.realised_speedup)
            except Exception:
                logger.exception("metrics update failed")

    @staticmethod
    def _decode_time_per_token(t_first: float | None, n_first: int, n_out: int, stats: dict | None) -> float:
        """Seconds per output token after the first, by the router's clock where the tokens came in
        several messages, else (one message: a non-streamed request) by the replica's."""
        if t_first is not None and n_out > n_first:
            return (time.perf_counter() - t_first) / (n_out - n_first)
        if stats and stats["output_tokens"] > 1:
            return (stats["latency_s"] - stats["first_token_s"]) / (stats["output_tokens"] - 1)
        return 0.0

    async def _migrating(self, plan: _Plan) -> AsyncIterator[dict]:
        """The request's deltas from its pool. If the replica serving it dies (or, in the separate
        topology, the Target), the request moves (migration, as NVIDIA Dynamo's): an engine replica
        prefills prompt + the tokens emitted so far and goes on from there, so the client's stream
        continues without a gap or a repeat. The router has every emitted token: it relayed them."""
        emitted: list[int] = []
        sent_chars = 0
        while True:
            resume = (emitted, sent_chars) if plan.migrations else None
            gen = self._run_separate(plan) if plan.pool == "separate" else self._run_engine(plan, resume)
            try:
                async for delta in gen:
                    emitted += delta["token_ids"]
                    sent_chars += len(delta["text"])
                    yield delta
                return
            except MIGRATABLE:
                if plan.migrations >= self.cfg.migration_limit:
                    raise
                lost, plan.pool = plan.pool, self._migration_pool(plan.pool)
                plan.migrations += 1
                self._migrations += 1
                self._active[lost] -= 1
                self._active[plan.pool] += 1
                self.metrics.migrations.inc(tags={"pool": lost})
                logger.warning("request %s: %s replica lost after %d tokens; continuing on %s", plan.request_id,
                               lost, len(emitted), plan.pool, exc_info=True)
            finally:
                await gen.aclose()

    def _migration_pool(self, lost: str) -> str:
        """Where a request goes when the replica serving it died: the same engine pool if it has
        other replicas, else another engine pool (the plain pool first: it needs no draft)."""
        if lost != "separate" and self._replicas.get(lost, 1) > 1:
            return lost
        others = [p for p in ("plain", "colocated") if p in self._pools and p != lost]
        return others[0] if others else lost

    async def _run_engine(self, plan: _Plan, resume: tuple[list[int], int] | None = None) -> AsyncIterator[dict]:
        p = plan.params
        k = p.num_speculative_tokens if plan.pool == "colocated" else 0  # the plain pool has no draft
        req = {"request_id": plan.request_id, "prompt_ids": plan.prompt_ids, "max_tokens": p.max_new_tokens,
               "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "seed": p.seed,
               "stop": list(p.stop), "ignore_eos": p.ignore_eos, "k": k,
               "adaptive_k": p.adaptive_k and k > 0, "domain": p.domain,
               "stream_interval_s": self.cfg.stream_interval_s if plan.stream else None, "resume": resume}
        responses = self._pools[plan.pool].options(stream=True).generate.remote(req)
        finished = False
        try:
            async for d in responses:
                self._engine_messages += 1
                finished = d["finished"]
                yield d
        finally:
            if not finished:
                responses.cancel()  # the replica's generator exits: the engine aborts and frees slots

    async def _run_separate(self, plan: _Plan) -> AsyncIterator[dict]:
        sid, p = plan.request_id, plan.params
        draft = self._draft.options(session_id=sid)
        target = self._target.options(session_id=sid)
        sampling = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "seed": p.seed}
        req = SeparateRequest(plan.request_id, plan.prompt_ids, p, self.tokenizer, self.eos_ids)
        t0 = time.perf_counter()
        draft_used = draft_failed = False
        first = True
        try:
            while not req.finished:
                # Step 1 is the target's prefill, without a proposal (as in the engine).
                # After a draft failure every separate request decodes plain for DRAFT_RETRY_S, then
                # tries the draft again: a dead Draft costs at most one step's wait, not a restart's.
                draft_up = time.monotonic() >= self._draft_down_until
                k = 0 if first or not draft_up else req.budget_k(p.num_speculative_tokens, self.max_model_len)
                history = list(req.tokens)
                if k > 0:
                    draft_used = True
                    proposal = draft.propose.remote(sid, history, k, sampling)  # not awaited: passed through
                    try:
                        outcome = await asyncio.wait_for(target.verify.remote(sid, history, proposal, sampling),
                                                         self.cfg.step_timeout_s)
                    except Exception as exc:  # the draft's failure, or the target's: re-raised
                        # A draft that does not answer in time (dead, restarting) has failed too.
                        if not isinstance(exc, asyncio.TimeoutError) and not await _failed(proposal):
                            raise
                        proposal.cancel()
                        if not draft_failed:
                            draft_failed = True
                            self._draft_failures += 1
                        self._draft_down_until = time.monotonic() + DRAFT_RETRY_S
                        logger.warning("request %s: draft propose failed; plain verify steps for %.0f s", sid,
                                       DRAFT_RETRY_S)
                        outcome = await self._plain_verify(target, sid, history, sampling)
                else:
                    outcome = await self._plain_verify(target, sid, history, sampling)
                first = False
                req.stats.record_verify(outcome["num_proposed"], outcome["num_accepted"])
                req.commit(outcome["emitted"])
                yield req.delta()
        finally:
            req.stats.latency_s = time.perf_counter() - t0
            self._release_later(sid, draft_used)
            if draft_failed:
                self.metrics.draft_failures.inc()
            if not req.finished:
                self._separate_aborted += 1
            s = req.stats
            logger.info(
                "request %s pool=separate mode=%s topology=separate k=%d prompt=%d output=%d proposed=%d "
                "accepted=%d acceptance=%.3f mean_len=%.2f latency=%.3fs finish=%s draft_failed=%s",
                sid, "speculative" if p.num_speculative_tokens else "plain", p.num_speculative_tokens,
                s.prompt_tokens, len(req.output_ids), s.proposed, s.accepted, s.acceptance_rate,
                s.mean_acceptance_length, s.latency_s, req.finish_reason or "abort", draft_failed,
            )

    async def _plain_verify(self, target: DeploymentHandle, sid: str, history: list[int], sampling: dict) -> dict:
        """A verify step without a proposal. Serve holds a call to a dead replica until its
        replacement is up (~15 s here): a step not answered within ``step_timeout_s`` counts as
        the Target lost, and the request migrates."""
        try:
            return await asyncio.wait_for(target.verify.remote(sid, history, None, sampling), self.cfg.step_timeout_s)
        except asyncio.TimeoutError:
            raise ReplicaLost(f"Target did not answer a verify within {self.cfg.step_timeout_s} s") from None

    def _release_later(self, session_id: str, draft_used: bool, attempt: int = 0) -> None:
        """Free the session's KV slots on both sides; runs even when the request was cancelled.

        The release runs in its own task with an empty context: no serve request context (so it is
        no child of the possibly cancelled request, whose cancellation Serve propagates to children)
        and no inherited cancel scope. Measured under disconnect storms: a release task created in
        the request's context was occasionally cancelled and leaked the session; if one still is,
        it is re-issued (up to 3 times)."""

        async def release() -> None:
            sides = [self._target] + ([self._draft] if draft_used else [])
            try:
                for handle in sides:
                    try:
                        await handle.options(session_id=session_id).release.remote(session_id)
                    except Exception:
                        logger.exception("release of session %s failed", session_id)
            except asyncio.CancelledError:
                if attempt < 3:
                    logger.warning("release of session %s cancelled; re-issuing", session_id)
                    self._release_later(session_id, draft_used, attempt + 1)
                raise

        task = asyncio.get_running_loop().create_task(release(), context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

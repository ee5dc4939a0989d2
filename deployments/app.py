"""The application builder named in serve_config.yaml (``import_path: deployments.app:build_app``).

    plain pool      EngineReplica(speculative=False)       deployment "PlainPool"
    co-located pool EngineReplica(speculative=True)        deployment "ColocatedPool"
    separate        Draft + Target (session affinity)      deployments "Draft", "Target"
    ingress         Router (FastAPI, OpenAI API)           deployment "Router"

Engine pools (plain, co-located) autoscale with ``autoscaling.scaling:PoolAutoscalingPolicy`` when
their ``autoscaling.enabled`` is set (config.py: AutoscalingOptions). A pool whose ``num_replicas``
is 0 (or that needs a draft when ``draft`` is null) is left out; the router routes around it.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.config import AppConfig, DeploymentOptions
from deployments.draft import Draft
from deployments.engine_replica import EngineReplica
from deployments.router import Router
from deployments.session_router import SessionAffinityRouter
from deployments.target import Target
from modelzoo.grow import build as build_model

# The replica half of Serve's throughput-optimized mode (RAY_SERVE_THROUGHPUT_OPTIMIZED): user code and
# the handle's request router run on the replica's main event loop, so a call or a streamed message
# does not hop between threads (and their GIL turns) on the way. A replica -> replica streamed call of
# 8 messages over gRPC: 2.8 -> 1.9 ms here (BENCHMARKS.md, "Serving overhead"). Engine replicas step on
# a thread of their own, so their loop is never blocked by a forward; Draft and Target run a step on
# the loop itself (deployments/step_replica.py: their channel's next message waits for the answer).
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def _options(opts: DeploymentOptions, name: str, **extra: Any) -> dict:
    scaling = getattr(opts, "autoscaling", None)
    replicas = ({"autoscaling_config": scaling.serve_config()} if scaling is not None and scaling.enabled
                else {"num_replicas": opts.num_replicas})
    return dict(
        name=name,
        **replicas,
        max_ongoing_requests=opts.max_ongoing_requests,
        ray_actor_options=opts.actor_options({"env_vars": REPLICA_ENV}),
        **extra,
    )


def _affinity() -> RequestRouterConfig:
    return RequestRouterConfig(request_router_class=SessionAffinityRouter)


def build_app(args: dict | None = None) -> Application:
    cfg = AppConfig(**(args or {})).resolved()
    for path in (cfg.target, cfg.draft):  # a model kept as a recipe (models/dram-wide) is built once, here,
        if path:                           # before any replica loads it
            build_model(path)
    config = cfg.model_dump()
    handles: dict[str, Any] = {}
    if cfg.has_plain:
        handles["plain"] = serve.deployment(EngineReplica).options(**_options(cfg.plain, "PlainPool")).bind(
            config, False, "plain")
    if cfg.has_colocated:
        handles["colocated"] = serve.deployment(EngineReplica).options(
            **_options(cfg.colocated, "ColocatedPool")).bind(config, True, "colocated")
    if cfg.has_separate:
        handles["draft"] = serve.deployment(Draft).options(
            **_options(cfg.draft_deployment, "Draft", request_router_config=_affinity())).bind(config)
        handles["target"] = serve.deployment(Target).options(
            **_options(cfg.target_deployment, "Target", request_router_config=_affinity())).bind(config)
    router_opts = cfg.router.model_copy(update={
        "max_ongoing_requests": max(cfg.router.max_ongoing_requests, cfg.max_inflight_requests + 16)})
    return serve.deployment(Router).options(**_options(router_opts, "Router")).bind(config, **handles)

"""The application config: one pydantic model, one described field per option.

``build_app(args)`` validates ``args`` (the ``args:`` block of serve_config.yaml) against
``AppConfig``; unknown keys are an error, so a typo cannot silently fall back to a default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec_core.kv_cache import KVWindow
from specdec_core.step_costs import SEPARATE_HOP_S

_PROJECT_ROOT = Path(__file__).resolve().parent.parent


class DeploymentOptions(BaseModel):
    """Ray Serve options of one deployment. ``num_cpus`` and ``num_gpus`` always travel together
    (a Serve ``ray_actor_options`` override replaces the whole dict, docs/ARCHITECTURE.md (Facts))."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=0, description="Replicas of this deployment; 0 disables it (not for the router).")
    num_cpus: float = Field(0.2, ge=0, description="CPUs reserved per replica (fractional is fine on small machines).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica; keep 0 on a machine without a GPU, "
                                                   "otherwise the app stays DEPLOYING forever.")
    max_ongoing_requests: int = Field(
        256, ge=1, description="Serve's per-replica cap on concurrent calls; too small makes a latency cliff."
    )
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per replica: "
                                        "places it on the nodes that offer them (`ray start --resources "
                                        "'{\"draft_node\": 1}'`), e.g. the Draft and the Target on different nodes.")
    label_selector: dict[str, str] = Field(default_factory=dict, description="Node labels a replica's node must "
                                           "have (`ray start --labels`, KubeRay worker-group labels), e.g. "
                                           "{\"ray.io/node-group\": \"target\"}.")

    def actor_options(self, runtime_env: dict) -> dict:
        """Serve's ``ray_actor_options`` (resources and labels only where set)."""
        extra = {k: v for k, v in (("resources", self.resources), ("label_selector", self.label_selector)) if v}
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "runtime_env": runtime_env, **extra}


class AutoscalingOptions(BaseModel):
    """Replica autoscaling of one engine pool with ``autoscaling.scaling:PoolAutoscalingPolicy``
    (Serve's own up/down delays are set to 0; the policy applies these)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Autoscale this pool; off: num_replicas is fixed.")
    min_replicas: int = Field(1, ge=0, description="Fewest replicas (>= 1 keeps the pool routable).")
    max_replicas: int = Field(1, ge=1, description="Most replicas.")
    target_ongoing_requests: float = Field(8.0, gt=0, description="Ongoing requests (or `metric`) per replica "
                                                                 "the policy aims at.")
    upscale_delay_s: float = Field(5.0, ge=0, description="A wish to scale up must hold this long.")
    downscale_delay_s: float = Field(60.0, ge=0, description="A wish to scale down must hold this long.")
    metric: str | None = Field("active_sequences", description="Replica-reported load "
                               "(EngineReplica.record_autoscaling_stats: running + waiting sequences); "
                               "null: Serve's ongoing requests.")

    @model_validator(mode="after")
    def _check(self) -> AutoscalingOptions:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self

    def serve_config(self) -> dict:
        """Serve's ``autoscaling_config`` with our policy."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": 0,
            "downscale_delay_s": 0,
            "policy": {
                "policy_function": "autoscaling.scaling:PoolAutoscalingPolicy",
                "policy_kwargs": {"target_ongoing_per_replica": self.target_ongoing_requests,
                                  "upscale_delay_s": self.upscale_delay_s,
                                  "downscale_delay_s": self.downscale_delay_s, "metric": self.metric},
            },
        }


class PoolOptions(DeploymentOptions):
    """An engine pool (plain or co-located): deployment options plus autoscaling."""

    autoscaling: AutoscalingOptions = Field(default_factory=AutoscalingOptions,
                                            description="Replica autoscaling (off by default).")

    @property
    def routing_replicas(self) -> int:
        """Replicas the router assumes when predicting the batch a request joins (autoscaled: the
        minimum, so the prediction errs towards larger batches)."""
        return max(self.autoscaling.min_replicas, 1) if self.autoscaling.enabled else self.num_replicas


def _opts(**kw) -> DeploymentOptions:
    return DeploymentOptions(**kw)


def _pool(**kw) -> PoolOptions:
    return PoolOptions(**kw)


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # ---- models ---------------------------------------------------------------------------------
    target: str = Field("models/target", description="Target model: local path (relative paths resolve against "
                                                     "the working directory, then the project root) or hub name.")
    draft: str | None = Field("models/draft", description="Draft model sharing the target's tokenizer; null "
                                                          "disables the co-located and separate speculative pools.")
    model_name: str = Field("specdec", description="The model id clients send in `model` and /v1/models lists.")
    device: str | None = Field(None, description="Torch device for the models (default: cuda if visible, else cpu).")
    dtype: str | None = Field(None, description="Torch dtype name (default: bfloat16 on CUDA, float32 on CPU).")
    max_model_len: int = Field(512, ge=8, description="Context limit in tokens (prompt + output) per request.")
    max_batch_size: int = Field(32, ge=1, description="KV slots per replica: sequences one replica decodes at once.")
    draft_kv_window: int | None = Field(None, ge=1, description="Bound the draft's KV cache to its attention sinks "
                                        "and this many recent tokens (StreamingLLM; MagicDec's draft): its per-step "
                                        "read and memory stop growing with the context. null: the whole context.")
    draft_kv_sinks: int = Field(4, ge=0, description="With draft_kv_window: the first tokens the draft always sees.")
    prefix_cache_tokens: int = Field(4096, ge=0, description="Automatic prefix caching: K/V of this many tokens "
                                     "per model and replica, kept from released requests in blocks of 16, so a "
                                     "request that starts the same way skips that prefill. 0: off.")
    trust_remote_code: bool = Field(False, description="Pass trust_remote_code to transformers when loading.")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per replica process.")
    engine_process: bool = Field(True, description="Plain and co-located replicas run their engine in a process of "
                                 "its own (deployments/engine_process.py), so its steps do not share a GIL with the "
                                 "replica's event loop and Ray's threads; false: on a thread of the replica.")

    # ---- speculation ----------------------------------------------------------------------------
    default_k: int = Field(4, ge=1, le=16, description="K of an explicit speculative request that gives none "
                                                  "(mode=auto: the router's cost model chooses K).")
    k_max: int = Field(8, ge=1, le=16, description="Largest K a request may ask for and the router may choose.")
    route_margin: float = Field(0.05, ge=0, description="mode=auto speculates only where the cost model predicts a "
                                                        "speedup above 1 + route_margin (autoscaling/routing.py).")
    route_split_margin: float = Field(0.10, ge=0, description="Where the pools share their cores "
                                      "(pools_share_compute), mode=auto leaves the pool that holds the load only "
                                      "for this much more predicted speedup (autoscaling/routing.py).")
    acceptance_prior: float = Field(0.6, gt=0, lt=1, description="Prior acceptance rate of the draft (e.g. from its "
                                                                 "model card) until a traffic class has evidence.")
    acceptance_prior_weight: float = Field(20.0, gt=0, description="Weight of that prior, in judged draft tokens.")
    acceptance_half_life_tokens: float = Field(2000.0, gt=0, description="Acceptance evidence halves every this "
                                                                         "many judged tokens of a traffic class.")
    acceptance_half_life_s: float = Field(120.0, gt=0, description="The router's acceptance evidence also halves "
                                          "every this many seconds, so a class that went plain (and judges no "
                                          "draft tokens) drifts back to the prior instead of freezing.")
    probe_share: float = Field(0.05, ge=0, le=1, description="Share of a traffic class's auto requests sent plain "
                               "for its acceptance that run as exploration probes (speculation, fixed K=2), so "
                               "that the estimate can recover (autoscaling/exploration.py); while the served "
                               "cost of plain steps at a batch is unmeasured, 4x this share of the auto requests "
                               "sent to speculation run plain (cost probes); 0: never.")
    max_traffic_classes: int = Field(64, ge=0, description="OpenAI `user` values that keep acceptance statistics "
                                     "(and metric labels) of their own, the most recently active after "
                                     "`traffic_class_promote_after` requests; every other user shares one of "
                                     "`traffic_class_buckets` hashed classes (autoscaling/traffic_classes.py).")
    traffic_class_buckets: int = Field(8, ge=1, description="Hashed classes shared by users without their own.")
    traffic_class_promote_after: int = Field(4, ge=1,
                                             description="Requests of a user before it gets a class of its own.")
    separate_hop_overhead_s: float = Field(SEPARATE_HOP_S, ge=0, description="Per-step orchestration overhead of "
                                           "the separate topology, a propose and a verify message over its channels "
                                           "(default: 1.6-2.2 ms measured on the 2-core CPU machine with `python -m "
                                           "specdec_bench.hops`).")
    calibration_file: str | None = Field(None, description="Calibration JSON (`specdec-calibrate`); a co-located "
                                         "replica uses its record for this target/draft/device instead of "
                                         "calibrating at start-up.")
    calibration_cache: bool = Field(True, description="A co-located replica that calibrates at start-up keeps "
                                    "the costs in a per-host cache (~/.cache/specdec-serve, keyed by the models' "
                                    "weight files, device, dtype, torch, the grid and the host): a restart on the "
                                    "same host loads them (the served family's calibration takes ~50 s on 2 vCPUs).")
    calibrate_on_start: bool = Field(True, description="Co-located replicas without a matching calibration record "
                                     "time their step costs at start-up (a few seconds on CPU); off: no adaptive "
                                     "K in the replica and the router keeps its prior cost table.")
    budgeted_verification: bool = Field(False, description="Co-located replicas plan every step for the batch as "
                                        "a whole: each auto request's K (0 allowed) under the step's cost, the rows "
                                        "verified at their own widths (specdec_core/step_planner.py), in place of "
                                        "each request's own adaptive K.")
    pools_share_compute: bool | None = Field(None, description="mode=auto prices speculation at the batch of the "
                                             "whole load (every pool's rows), not the pool's own, because the pools' "
                                             "engines take their time from one set of cores; null: yes where the "
                                             "engine processes' torch threads outnumber the node's CPUs (a CPU "
                                             "device) or a target-bearing pool takes a fraction of a GPU.")
    separate_overlap: Literal["auto", "always", "never"] = Field(
        "auto", description="Separate topology: the Draft proposes a request's next round while the Target verifies "
        "this one (PEARL's post-verify, deployments/separate_loop.py). auto: where the cost model says it pays "
        "(CostModel.overlap_pays); always / never: for measurements (routing prices auto's choice).")

    # ---- API --------------------------------------------------------------------------------------
    max_inflight_requests: int = Field(64, ge=1, description="Requests the router serves at once; above it new "
                                                             "requests get 503 instead of queueing unboundedly.")
    default_max_tokens: int = Field(16, ge=1, description="max_tokens of a completion that gives none (OpenAI: 16).")
    chat_default_max_tokens: int = Field(256, ge=1, description="max_tokens of a chat completion that gives none "
                                                                "(capped by the context left after the prompt).")
    stream_interval_s: float = Field(0.02, ge=0, description="Streamed requests: an engine replica sends the "
                                     "tokens of the steps within this interval as one message (the first "
                                     "at once); 0: one message per step. Non-streamed requests get one "
                                     "message in all. Ray Serve LLM batches streams the same way.")
    migration_limit: int = Field(3, ge=0, description="Times one request may move to another replica or pool "
                                 "when the replica serving it dies (0: a replica death fails its requests).")
    step_timeout_s: float = Field(2.0, gt=0, description="Separate topology: a replica that does not answer a "
                                  "step within this time is presumed lost (one that died closes its channel at "
                                  "once): a Draft's requests decode plain and speculation pauses for 5 s; a "
                                  "Target's requests move to an engine pool.")
    channel_max_frame_bytes: int | None = Field(None, ge=1024, description="Separate topology: the largest frame "
                                                "a channel end reads (a larger one closes the connection before it "
                                                "is buffered). Null: twice the largest real step message, a batch of "
                                                "`max_batch_size` proposals of `k_max` fp32 draft distributions over "
                                                "the vocabulary plus full contexts (`channel_frame_bound`).")
    channel_handshake_timeout_s: float = Field(5.0, gt=0, description="Separate topology: a connection to a "
                                               "Draft/Target channel that has not presented the replica's token "
                                               "within this time is closed.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body; a larger one gets 413 before "
                                "it is read (a full context of text is a few KB).")
    max_header_bytes: int = Field(32 << 10, ge=1024, description="Largest total size of a request's headers; "
                                  "above it 431.")
    api_key: str | None = Field(None, description="If set, every /v1 endpoint requires `Authorization: Bearer "
                                "<api_key>` (OpenAI style, as vLLM's --api-key); /health stays open. Null: no key.")

    # ---- deployments ------------------------------------------------------------------------------
    router: DeploymentOptions = Field(
        default_factory=lambda: _opts(num_cpus=0.1, max_ongoing_requests=1024),
        description="The HTTP ingress (tokenizes, routes, runs the separate topology's loop).",
    )
    plain: PoolOptions = Field(default_factory=lambda: _pool(num_cpus=0.3),
                                     description="Plain pool: EngineReplica without a draft.")
    colocated: PoolOptions = Field(default_factory=lambda: _pool(num_cpus=0.3),
                                         description="Co-located speculative pool: EngineReplica with draft + target.")
    draft_deployment: DeploymentOptions = Field(default_factory=lambda: _opts(num_cpus=0.2),
                                                description="Separate topology: the Draft deployment.")
    target_deployment: DeploymentOptions = Field(default_factory=lambda: _opts(num_cpus=0.3),
                                                 description="Separate topology: the Target deployment.")

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if self.router.num_replicas < 1:
            raise ValueError("router.num_replicas must be >= 1")
        if self.default_k > self.k_max:
            raise ValueError(f"default_k ({self.default_k}) > k_max ({self.k_max})")
        if (self.draft_deployment.num_replicas > 0) != (self.target_deployment.num_replicas > 0):
            raise ValueError("the separate topology needs both draft_deployment and target_deployment replicas")
        if not (self.has_plain or self.colocated.num_replicas or self.colocated.autoscaling.enabled
                or self.target_deployment.num_replicas):
            raise ValueError("no pool has replicas")
        return self

    # ---- derived ----------------------------------------------------------------------------------
    def channel_frame_bound(self, vocab_size: int) -> int:
        """``channel_max_frame_bytes``, or twice the largest step message: every slot's proposal of
        ``k_max`` fp32 distributions over the vocabulary, and every slot's full context (msgpack: at
        most 5 bytes a token id), with 64 KiB for the envelope."""
        if self.channel_max_frame_bytes is not None:
            return self.channel_max_frame_bytes
        per_item = self.k_max * vocab_size * 4 + 5 * (self.max_model_len + self.k_max)
        return 2 * self.max_batch_size * per_item + (64 << 10)

    @property
    def draft_window(self) -> KVWindow | None:
        """The draft's bounded cache (``draft_kv_window``), or None: the whole context."""
        return KVWindow(self.draft_kv_sinks, self.draft_kv_window) if self.draft_kv_window else None

    @property
    def has_plain(self) -> bool:
        return self.plain.num_replicas > 0 or self.plain.autoscaling.enabled

    @property
    def has_colocated(self) -> bool:
        return self.draft is not None and (self.colocated.num_replicas > 0 or self.colocated.autoscaling.enabled)

    @property
    def has_separate(self) -> bool:
        return self.draft is not None and self.target_deployment.num_replicas > 0

    def pools_share_compute_on(self, cpus: int) -> bool:
        """``pools_share_compute``, or where null whether the pools' engines share their compute on a node of
        ``cpus`` CPUs: measured on 2 vCPUs, auto splitting c=8 over three pools served 0.95x of plain alone,
        each pool priced at its own batch (BENCHMARKS.md, "Pricing the whole load on shared cores")."""
        if self.pools_share_compute is not None:
            return self.pools_share_compute
        targets = [p for p, on in ((self.plain, self.has_plain), (self.colocated, self.has_colocated),
                                   (self.target_deployment, self.has_separate)) if on]
        if any(p.num_gpus > 0 for p in targets):
            return any(p.num_gpus < 1 for p in targets)
        processes = (self.plain.routing_replicas if self.has_plain else 0) \
            + (self.colocated.routing_replicas if self.has_colocated else 0)
        if self.has_separate:
            processes += self.target_deployment.num_replicas + self.draft_deployment.num_replicas
        return processes * self.torch_threads > cpus

    def resolved(self) -> AppConfig:
        """A copy with local model paths made absolute, so replicas find them whatever their cwd."""
        return self.model_copy(update={
            "target": resolve_model_path(self.target),
            "draft": resolve_model_path(self.draft) if self.draft else None,
            "calibration_file": resolve_model_path(self.calibration_file) if self.calibration_file else None})


def model_label(path: str | None) -> str | None:
    """A model's name for clients, metrics and logs: the last part of its path or hub name, never
    the filesystem path."""
    return Path(path).name if path else None


def resolve_model_path(path: str) -> str:
    """cwd-relative if it exists there, else project-root-relative if it exists there, else unchanged
    (a hub name, or a path that fails loudly at load time)."""
    p = Path(os.path.expanduser(path))
    if p.is_absolute():
        return str(p)
    for base in (Path.cwd(), _PROJECT_ROOT):
        if (base / p).exists():
            return str((base / p).resolve())
    return path

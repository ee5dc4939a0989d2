"""Prometheus metrics of the router, defined once (``ray.serve.metrics``; exported by the node's
metrics agent with a ``ray_`` prefix, e.g. ``ray_specdec_requests_total``). README "## Metrics"
lists them.

Definitions follow specdec_core/stats.py: acceptance rate = accepted / proposed; mean acceptance
length = (accepted + verify steps) / verify steps, which counts the bonus token. Per-position
acceptance = accepted at position i / judged at position i (a position after the first rejection of
a step is not judged, acceptance.py). Realised speedup = the cost model's plain step time per token
at the batch the request joined / the request's measured decode time per token (router clock, from
its first to its last token delta); predicted speedup = the routing decision's.
"""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

_TAGS = ("pool", "mode", "topology")
_LATENCY_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
_RATE = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
_LENGTH = [1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 9, 17]
_K = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 8.5, 12.5, 16.5]  # bucket le=0.5 counts K=0 (bounds must be > 0)
_SPEEDUP = [0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 3, 4]
_CLASS = ("draft", "temperature_bucket", "domain")


class RouterMetrics:
    def __init__(self):
        self.requests = Counter("specdec_requests_total", "Finished requests by route and finish reason.",
                                _TAGS + ("finish",))
        self.rejected = Counter("specdec_rejected_total", "Requests refused before running (4xx/5xx).",
                                ("status",))
        self.output_tokens = Counter("specdec_output_tokens_total", "Emitted tokens, by pool and mode "
                                     "(speculative / plain).", _TAGS)
        self.proposed = Counter("specdec_proposed_tokens_total", "Draft tokens sent to verification.", _TAGS)
        self.accepted = Counter("specdec_accepted_tokens_total", "Draft tokens the target kept.", _TAGS)
        self.verify_steps = Counter("specdec_verify_steps_total", "Target passes that judged draft tokens.", _TAGS)
        self.draft_failures = Counter("specdec_draft_failures_total", "Separate-topology requests whose draft "
                                      "failed and fell back to plain verify.")
        self.migrations = Counter("specdec_migrations_total", "Requests moved to another replica or pool because "
                                  "the replica serving them died, by the pool that lost it.", ("pool",))
        self.latency = Histogram("specdec_request_latency_s", "Request latency in the router.", _LATENCY_S, _TAGS)
        self.inflight = Gauge("specdec_inflight_requests", "Requests the router serves now.")
        # acceptance
        self.acceptance_rate = Histogram("specdec_acceptance_rate", "Per speculative request: accepted / proposed.",
                                         _RATE, _TAGS)
        self.acceptance_length = Histogram("specdec_mean_acceptance_length", "Per speculative request: tokens per "
                                           "verify step, bonus token included.", _LENGTH, _TAGS)
        self.position_acceptance = Gauge("specdec_position_acceptance_rate", "Acceptance rate at draft position i "
                                         "of a traffic class (the router's tracker, shrunk to its estimate).",
                                         _CLASS + ("position",))
        self.acceptance_estimate = Gauge("specdec_acceptance_estimate", "The router's acceptance estimate per "
                                         "traffic class (what routing uses).", _CLASS)
        # routing
        self.decisions = Counter("specdec_route_decisions_total", "Routing decisions by pool, regime and "
                                 "requested mode.", ("pool", "regime", "requested_mode"))
        self.chosen_k = Histogram("specdec_chosen_k", "K chosen by the router (0: plain).", _K, ("pool",))
        self.running = Gauge("specdec_pool_running", "Requests the router has running in each pool (the batch "
                             "the cost model prices).", ("pool",))
        self.predicted_speedup = Histogram("specdec_predicted_speedup", "Speedup over plain the routing decision "
                                           "predicted.", _SPEEDUP, ("pool", "regime"))
        self.realised_speedup = Histogram("specdec_realised_speedup", "Plain time per token (cost model, at the "
                                          "joined batch) / measured decode time per token.", _SPEEDUP,
                                          ("pool", "regime"))

    def routed(self, pool: str, k: int, regime: str, requested_mode: str, predicted: float) -> None:
        self.decisions.inc(tags={"pool": pool, "regime": regime, "requested_mode": requested_mode})
        self.chosen_k.observe(k, tags={"pool": pool})
        self.predicted_speedup.observe(predicted, tags={"pool": pool, "regime": regime})

    def set_running(self, pool: str, n: int) -> None:
        self.running.set(n, tags={"pool": pool})

    def finished(self, pool: str, k: int, topology: str | None, finish: str, stats: dict, latency_s: float,
                 regime: str = "unknown", realised: float | None = None) -> None:
        tags = {"pool": pool, "mode": "speculative" if k else "plain", "topology": topology or "none"}
        self.requests.inc(tags={**tags, "finish": finish})
        for counter, key in ((self.output_tokens, "output_tokens"), (self.proposed, "proposed_tokens"),
                             (self.accepted, "accepted_tokens"), (self.verify_steps, "verify_steps")):
            if stats.get(key):  # Ray counters reject inc(0)
                counter.inc(stats[key], tags=tags)
        self.latency.observe(latency_s, tags=tags)
        if stats.get("proposed_tokens"):
            self.acceptance_rate.observe(stats["acceptance_rate"], tags=tags)
            self.acceptance_length.observe(stats["mean_acceptance_length"], tags=tags)
        if realised is not None:
            self.realised_speedup.observe(realised, tags={"pool": pool, "regime": regime})

    def acceptance(self, cls, estimate: float, per_position: list[float]) -> None:
        tags = {"draft": cls.draft, "temperature_bucket": cls.temperature_bucket, "domain": cls.domain}
        self.acceptance_estimate.set(estimate, tags=tags)
        for i, rate in enumerate(per_position):
            self.position_acceptance.set(rate, tags={**tags, "position": str(i)})

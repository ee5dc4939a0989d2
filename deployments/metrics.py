"""Prometheus metrics of the router, defined once (``ray.serve.metrics``; exported by the node's
metrics agent with a ``ray_`` prefix, e.g. ``ray_specdec_requests_total``).

Definitions follow specdec_core/stats.py: acceptance rate = accepted / proposed; mean acceptance
length = (accepted + verify steps) / verify steps, which counts the bonus token.
"""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

_TAGS = ("pool", "mode", "topology")
_LATENCY_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


class RouterMetrics:
    def __init__(self):
        self.requests = Counter("specdec_requests_total", "Finished requests by route and finish reason.",
                                _TAGS + ("finish",))
        self.rejected = Counter("specdec_rejected_total", "Requests refused before running (4xx/5xx).",
                                ("status",))
        self.output_tokens = Counter("specdec_output_tokens_total", "Emitted tokens.", _TAGS)
        self.proposed = Counter("specdec_proposed_tokens_total", "Draft tokens sent to verification.", _TAGS)
        self.accepted = Counter("specdec_accepted_tokens_total", "Draft tokens the target kept.", _TAGS)
        self.verify_steps = Counter("specdec_verify_steps_total", "Target passes that judged draft tokens.", _TAGS)
        self.draft_failures = Counter("specdec_draft_failures_total", "Separate-topology requests whose draft "
                                      "failed and fell back to plain verify.")
        self.latency = Histogram("specdec_request_latency_s", "Request latency in the router.", _LATENCY_S, _TAGS)
        self.inflight = Gauge("specdec_inflight_requests", "Requests the router serves now.")

    def finished(self, pool: str, k: int, topology: str | None, finish: str, stats: dict, latency_s: float) -> None:
        tags = {"pool": pool, "mode": "speculative" if k else "plain", "topology": topology or "none"}
        self.requests.inc(tags={**tags, "finish": finish})
        for counter, key in ((self.output_tokens, "output_tokens"), (self.proposed, "proposed_tokens"),
                             (self.accepted, "accepted_tokens"), (self.verify_steps, "verify_steps")):
            if stats.get(key):  # Ray counters reject inc(0)
                counter.inc(stats[key], tags=tags)
        self.latency.observe(latency_s, tags=tags)

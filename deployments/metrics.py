"""Prometheus metrics of the router, defined once (``ray.serve.metrics``; exported by the node's
metrics agent with a ``ray_`` prefix, e.g. ``ray_specdec_requests_total``). README "## Metrics"
lists them.

Definitions follow specdec_core/stats.py: acceptance rate = accepted / proposed; mean acceptance
length = (accepted + verify steps) / verify steps, which counts the bonus token. Per-position
acceptance = accepted at position i / judged at position i (a position after the first rejection of
a step is not judged, acceptance.py). Realised speedup = the cost model's plain step time per token
at the batch the request joined / the request's measured decode time per token (router clock, from
its first to its last token delta); predicted speedup = the routing decision's. TTFT = from the
router's hand-off to the pool to the first token delta (streamed; a one-message response: the
replica's own first-token time); TPOT = the decode time per token after the first (as realised
speedup's). A straggler is a speculative request whose realised speedup is below 1: speculation made
it slower than plain would have been.
"""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

from specdec_core.stats import RequestStats

_TAGS = ("pool", "mode", "topology")
_LATENCY_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
_TPOT_S = [0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 1]
_RATE = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
_LENGTH = [1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 9, 17]
_K = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 8.5, 12.5, 16.5]  # bucket le=0.5 counts K=0 (bounds must be > 0)
_SPEEDUP = [0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 3, 4]
_CLASS = ("draft", "temperature_bucket", "domain")


class RouterMetrics:
    def __init__(self, max_domain_labels: int = 73):
        # Ray exports every label set it ever saw: traffic-class domains beyond the first this many
        # share the label "~other", so a churn of users cannot grow the label sets without bound.
        self._max_domain_labels = max_domain_labels
        self._domain_labels: set[str] = set()
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
        self.latency = Histogram("specdec_request_latency_s", "Request latency in the router (end to end).",
                                 _LATENCY_S, _TAGS)
        self.ttft = Histogram("specdec_time_to_first_token_s", "Time to the first token, from the router's "
                              "hand-off to the pool.", _LATENCY_S, _TAGS)
        self.tpot = Histogram("specdec_time_per_output_token_s", "Decode time per output token after the first.",
                              _TPOT_S, _TAGS)
        self.stragglers = Counter("specdec_speculative_stragglers_total", "Speculative requests whose realised "
                                  "speedup was below 1 (slower than plain decoding would have been).",
                                  ("pool", "regime"))
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

    def finished(self, pool: str, k: int, topology: str | None, finish: str, stats: RequestStats | None,
                 latency_s: float, regime: str = "unknown", realised: float | None = None,
                 ttft_s: float | None = None, tpot_s: float | None = None) -> None:
        tags = {"pool": pool, "mode": "speculative" if k else "plain", "topology": topology or "none"}
        self.requests.inc(tags={**tags, "finish": finish})
        if stats is not None:
            for counter, n in ((self.output_tokens, stats.output_tokens), (self.proposed, stats.proposed),
                               (self.accepted, stats.accepted), (self.verify_steps, stats.verify_steps)):
                if n:  # Ray counters reject inc(0)
                    counter.inc(n, tags=tags)
        self.latency.observe(latency_s, tags=tags)
        if stats is not None and stats.proposed:
            self.acceptance_rate.observe(stats.acceptance_rate, tags=tags)
            self.acceptance_length.observe(stats.mean_acceptance_length, tags=tags)
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags=tags)
        if tpot_s:
            self.tpot.observe(tpot_s, tags=tags)
        if realised is not None:
            self.realised_speedup.observe(realised, tags={"pool": pool, "regime": regime})
            if k and realised < 1:
                self.stragglers.inc(tags={"pool": pool, "regime": regime})

    def _domain_label(self, domain: str) -> str:
        if domain not in self._domain_labels and len(self._domain_labels) >= self._max_domain_labels:
            return "~other"
        self._domain_labels.add(domain)
        return domain

    def acceptance(self, cls, estimate: float, per_position: list[float]) -> None:
        tags = {"draft": cls.draft, "temperature_bucket": cls.temperature_bucket,
                "domain": self._domain_label(cls.domain)}
        self.acceptance_estimate.set(estimate, tags=tags)
        for i, rate in enumerate(per_position):
            self.position_acceptance.set(rate, tags={**tags, "position": str(i)})


def log_request(logger, request_id: str, pool: str, k: int, topology: str | None, prompt_tokens: int,
                stats: RequestStats | None, latency_s: float, finish: str, **extra) -> None:
    """The one log line per request, the same from every pool (mode, topology, tokens, acceptance)."""
    s = stats or RequestStats()
    tail = "".join(f" {key}={value}" for key, value in extra.items())
    logger.info(
        "request %s pool=%s mode=%s topology=%s k=%d prompt=%d output=%d proposed=%d accepted=%d "
        "acceptance=%.3f mean_len=%.2f latency=%.3fs finish=%s%s",
        request_id, pool, "speculative" if k else "plain", topology if k else None, k, prompt_tokens,
        s.output_tokens, s.proposed, s.accepted, s.acceptance_rate, s.mean_acceptance_length, latency_s, finish, tail,
    )

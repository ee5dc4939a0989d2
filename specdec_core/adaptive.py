"""Adaptive K inside an engine: re-choose each request's K every step from the cost model and
the evidence, so a request whose acceptance collapses drops to K=0 (plain decoding) without
leaving its replica, and climbs back when a probe shows acceptance has returned.

Per step, a request's acceptance a is its own judged evidence (accepted / judged positions, the
unbiased estimator of ``acceptance.py``) shrunk towards its traffic class's estimate, which acts
as a prior of ``prior_weight`` tokens; the choice itself is ``costmodel.adaptive_k`` (goodput-
optimal K under E_K(a) = (1 - a^(K+1)) / (1 - a), Leviathan et al. 2023, with hysteresis).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec_core.acceptance import AcceptanceTracker, TrafficClass
from specdec_core.costmodel import CostModel, adaptive_k


@dataclass
class KState:
    k: int
    steps_at_current: int = 0


class AdaptiveK:
    def __init__(
        self,
        cost_model: CostModel,
        tracker: AcceptanceTracker,
        draft_name: str,
        topology: str = "colocated",
        probe_every: int = 16,
    ):
        self.cost_model = cost_model
        self.tracker = tracker
        self.draft_name = draft_name
        self.topology = topology
        self.probe_every = probe_every

    def traffic_class(self, temperature: float, domain: str) -> TrafficClass:
        return TrafficClass.of(self.draft_name, temperature, domain)

    def acceptance(self, cls: TrafficClass, accepted: int, judged: int) -> float:
        prior_weight = self.tracker.prior_weight
        return (accepted + prior_weight * self.tracker.estimate(cls)) / (judged + prior_weight)

    def choose(self, state: KState | None, cls: TrafficClass, accepted: int, judged: int, batch: int,
               k_max: int, remaining_tokens: int = 1 << 30, catch_up_tokens: int = 0) -> KState:
        """The next K for one request; ``state`` None on its first decode step.

        On the first step the draft has not seen the prompt yet: speculation starts only if its
        expected saving over the remaining tokens exceeds the draft's prefill of
        ``catch_up_tokens`` (the prefill-heavy regime); otherwise the request decodes plainly.
        """
        a = self.acceptance(cls, accepted, judged)
        if state is None:
            best = self.cost_model.best_k(batch, a, k_max, self.topology)
            plain = self.cost_model.plain_time_per_token(batch)
            saving = remaining_tokens * (plain - best.time_per_token_s)
            prefill = catch_up_tokens * self.cost_model.costs.draft_prefill_s_per_token
            return KState(best.k if saving > prefill else 0)
        k = adaptive_k(
            self.cost_model, batch, a, k_max, state.k, state.steps_at_current, self.topology,
            probe_every=self.probe_every,
        )
        return KState(state.k if k == state.k else k, state.steps_at_current + 1 if k == state.k else 0)

    def observe(self, cls: TrafficClass, proposed: int, accepted: int) -> None:
        self.tracker.observe(cls, proposed, accepted)

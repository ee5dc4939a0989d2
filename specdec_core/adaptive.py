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

from specdec_core.acceptance import AcceptanceTracker, TrafficClass, temperature_bucket
from specdec_core.costmodel import PROBE_CEILING, CostModel, adaptive_k


@dataclass
class KState:
    k: int
    steps_at_current: int = 0
    probe_every: int = 16  # steps at K=0 before a probe; doubles after every drop to K=0


class AdaptiveK:
    def __init__(
        self,
        cost_model: CostModel,
        tracker: AcceptanceTracker,
        draft_name: str,
        topology: str = "colocated",
        probe_every: int = 16,
        max_probe_every: int = 256,
        sampled_cost_model: CostModel | None = None,
    ):
        self.cost_model = cost_model
        # Sampling costs more per step than greedy argmaxes (draft distributions, the rejection
        # sampler: +15-20% of a batch-1 step here), so sampled traffic may get its own costs.
        self.sampled_cost_model = sampled_cost_model or cost_model
        self.tracker = tracker
        self.draft_name = draft_name
        self.topology = topology
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every

    def traffic_class(self, temperature: float, domain: str) -> TrafficClass:
        return TrafficClass.of(self.draft_name, temperature, domain)

    def cost_model_for(self, cls: TrafficClass) -> CostModel:
        return self.cost_model if cls.temperature_bucket == temperature_bucket(0.0) else self.sampled_cost_model

    def acceptance(self, cls: TrafficClass, accepted: int, judged: int) -> float:
        prior_weight = self.tracker.prior_weight
        return (accepted + prior_weight * self.tracker.estimate(cls)) / (judged + prior_weight)

    def choose(self, state: KState | None, cls: TrafficClass, accepted: int, judged: int, batch: int,
               k_max: int, remaining_tokens: int = 1 << 30, catch_up_tokens: int = 0) -> KState:
        """The next K for one request; ``state`` None on its first decode step.

        ``catch_up_tokens`` is what the draft has not seen: the prompt on the first step, the tokens
        emitted during plain steps later. Speculation starts (or a probe runs) only if its saving
        over the remaining tokens can pay the draft's catch-up prefill (the prefill-heavy and
        long-context regimes); on the first step the saving is priced at the acceptance estimate,
        for a probe at ``PROBE_CEILING`` (could it pay if acceptance were back?).
        """
        a = self.acceptance(cls, accepted, judged)
        model = self.cost_model_for(cls)
        if state is None:
            k = model.best_k(batch, a, k_max, self.topology).k
            pays = self._pays_for_catch_up(model, batch, a, k_max, remaining_tokens, catch_up_tokens)
            return KState(k if pays else 0, probe_every=self.probe_every)
        k = adaptive_k(
            model, batch, a, k_max, state.k, state.steps_at_current, self.topology,
            probe_every=state.probe_every,
        )
        if state.k == 0 and k > 0 and not self._pays_for_catch_up(
            model, batch, max(a, PROBE_CEILING), k_max, remaining_tokens, catch_up_tokens
        ):
            k = 0
        if k == state.k:
            return KState(k, state.steps_at_current + 1, state.probe_every)
        # Back off: every fall to plain (a failed probe or a collapse) doubles the wait before the
        # next probe, so traffic where speculation keeps losing pays for fewer probes; speculating
        # beyond the probe's K shows that acceptance has returned and resets it.
        if k == 0:
            probe_every = min(2 * state.probe_every, self.max_probe_every)
        elif k > 1:
            probe_every = self.probe_every
        else:
            probe_every = state.probe_every
        return KState(k, 0, probe_every)

    def _pays_for_catch_up(self, model: CostModel, batch: int, a: float, k_max: int, remaining_tokens: int,
                           catch_up_tokens: int) -> bool:
        best = model.best_k(batch, a, k_max, self.topology)
        saving = remaining_tokens * (model.plain_time_per_token(batch) - best.time_per_token_s)
        return saving > catch_up_tokens * model.costs.draft_prefill_s_per_token

    def observe(self, cls: TrafficClass, proposed: int, accepted: int) -> None:
        self.tracker.observe(cls, proposed, accepted)

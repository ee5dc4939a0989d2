"""Adaptive K inside an engine: re-choose each request's K every step from the cost model and
the evidence, so a request whose acceptance collapses drops to K=0 (plain decoding) without
leaving its replica, and climbs back when a probe shows acceptance has returned.

Per step, a request's acceptance a is its own judged evidence (accepted / judged positions, the
unbiased estimator of ``acceptance.py``) shrunk towards its traffic class's estimate, which acts
as a prior of ``prior_weight`` tokens; the choice itself is ``costmodel.adaptive_k`` (goodput-
optimal K under E_K(a) = (1 - a^(K+1)) / (1 - a), Leviathan et al. 2023, with hysteresis),
priced by the costs of the request's sampling path at its context length, corrected by the drift
of real steps from the calibration (``StepDrift``). A ragged batch is padded to its widest row,
so the engine lets a step speculate only if the whole batch gains (``batch_pays``). Probes run
per request once it has evidence of its own, per traffic class before (``choose``).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec_core.acceptance import AcceptanceTracker, TrafficClass, temperature_bucket
from specdec_core.costmodel import PROBE_CEILING, CostModel, StepDrift, adaptive_k, expected_tokens_per_step

CONTEXT_BUCKET = 64  # tokens: adaptive K prices a request at its context rounded up to this
GREEDY_BUCKET = temperature_bucket(0.0)
REPRICE_EVERY = 4  # steps between re-pricings of a request at K=0
PROBE_BUDGET = 0.05  # share of a request's remaining decode time a probe's draft catch-up may take


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
        self._by_context: dict[tuple[bool, int], CostModel] = {}
        self.drift = StepDrift()  # shared by every cost model below
        self.tracker = tracker
        self.draft_name = draft_name
        self.topology = topology
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self._class_probes: dict[TrafficClass, KState] = {}  # probe schedule of evidence-less requests

    def traffic_class(self, temperature: float, domain: str) -> TrafficClass:
        return TrafficClass.of(self.draft_name, temperature, domain)

    def cost_model_for(self, cls: TrafficClass, context_len: int = 0) -> CostModel:
        """The cost model for this class's sampling path, priced at the context (rounded up to a
        multiple of 64 tokens, and cached, so a step does not rebuild a grid per request)."""
        greedy = cls.temperature_bucket == GREEDY_BUCKET
        key = (greedy, -(-context_len // CONTEXT_BUCKET))
        model = self._by_context.get(key)
        if model is None:
            base = self.cost_model if greedy else self.sampled_cost_model
            model = CostModel(base.costs.at_context(key[1] * CONTEXT_BUCKET), drift=self.drift)
            self._by_context[key] = model
        return model

    def acceptance(self, cls: TrafficClass, accepted: int, judged: int) -> float:
        prior_weight = self.tracker.prior_weight
        return (accepted + prior_weight * self.tracker.estimate(cls)) / (judged + prior_weight)

    def choose(self, state: KState | None, cls: TrafficClass, accepted: int, judged: int, batch: int,
               k_max: int, remaining_tokens: int = 1 << 30, catch_up_tokens: int = 0, context_len: int = 0
               ) -> KState:
        """The next K for one request; ``state`` None on its first decode step.

        ``catch_up_tokens`` is what the draft has not seen: the prompt on the first step, the tokens
        emitted during plain steps later. Speculation starts (or a probe runs) only if its saving
        over the remaining tokens can pay the draft's catch-up prefill (the prefill-heavy and
        long-context regimes); on the first step the saving is priced at the acceptance estimate,
        for a probe at ``PROBE_CEILING`` (could it pay if acceptance were back?) and within
        ``PROBE_BUDGET``.
        """
        if state is not None and state.k == 0:
            kept = self._keep_plain_unpriced(state, cls, judged)
            if kept is not None:
                return kept
        a = self.acceptance(cls, accepted, judged)
        model = self.cost_model_for(cls, context_len)
        if state is None:  # as if at K=0: speculation must beat plain by the margin to start
            k = adaptive_k(model, batch, a, k_max, 0, 0, self.topology, probe_every=self.probe_every)
            pays = self._pays_for_catch_up(model, batch, a, k_max, remaining_tokens, catch_up_tokens)
            return KState(k if pays else 0, probe_every=self.probe_every)
        # A request at K=0 with no judged tokens of its own knows only its class's estimate, so a
        # probe would test the class: it runs on the class's schedule (one probe per probe_every
        # plain row-steps of the class, backing off across requests), not once per request.
        own = state.k > 0 or judged > 0
        schedule = self._probe_schedule(state, cls, own)
        k = adaptive_k(
            model, batch, a, k_max, state.k, schedule.steps_at_current, self.topology,
            probe_every=schedule.probe_every,
        )
        if state.k == 0 and k > 0 and not self._probe_affordable(
            model, batch, a, k_max, remaining_tokens, catch_up_tokens
        ):
            k = 0
        if k > 1:
            self._class_probes.pop(cls, None)  # speculation pays: class probes restart at the base wait
        if own:
            return self._advance(state, k)
        if k == 0:
            self._class_probes[cls] = self._advance(schedule, 0)
            return KState(0, state.steps_at_current + 1, state.probe_every)
        wait = min(2 * schedule.probe_every, self.max_probe_every)
        if k == 1:  # the class's probe: the next one waits twice as long
            self._class_probes[cls] = KState(0, 0, wait)
        return KState(k, 0, wait if k == 1 else self.probe_every)

    def _keep_plain_unpriced(self, state: KState, cls: TrafficClass, judged: int) -> KState | None:
        """At K=0 a request gains no evidence of its own and its other inputs (class estimate,
        drift, context) move slowly, so it is re-priced every ``REPRICE_EVERY`` steps and whenever
        a probe is due; in between it stays plain (pricing is ~25 us a row: ~1% of a batch-1 step
        here, 2-3% at batch 4)."""
        own = judged > 0
        schedule = self._probe_schedule(state, cls, own)
        if (state.steps_at_current + 1) % REPRICE_EVERY == 0 or schedule.steps_at_current >= schedule.probe_every:
            return None
        if own:
            return self._advance(state, 0)
        self._class_probes[cls] = self._advance(schedule, 0)
        return KState(0, state.steps_at_current + 1, state.probe_every)

    def _probe_schedule(self, state: KState, cls: TrafficClass, own: bool) -> KState:
        """Whose probe clock applies: the request's own once it has evidence, else its class's."""
        return state if own else self._class_probes.get(cls, KState(0, 0, self.probe_every))

    def _advance(self, state: KState, k: int) -> KState:
        """A request's state after choosing ``k``."""
        if k == state.k:
            if k == 0 and state.steps_at_current >= state.probe_every:
                # The probe was declined (hopeless or unaffordable): wait another period before
                # asking again, rather than re-pricing it every step.
                return KState(0, 0, state.probe_every)
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

    def observe_step(self, cls: TrafficClass, context_len: int, batch: int, k: int, seconds: float) -> None:
        """A decode step whose rows all ran at K (K=0: plain) took ``seconds`` (propose + verify)."""
        model = self.cost_model_for(cls, context_len)
        self.drift.observe(k, seconds, model.calibrated_step_time(batch, k, self.topology), batch)

    def batch_pays(self, model: CostModel, ks: list[int], acceptances: list[float]) -> bool:
        """Does this step's mix of K beat a plain step for the batch as a whole?

        Each row chose its K as if the batch shared it, but a ragged batch is padded: one row at
        K=1 among plain rows makes every row's verify two tokens wide and adds a draft forward.
        Rows at K=0 emit one token, speculative rows E_K(a) on average; the step pays if the batch
        emits tokens faster than plain steps would. For a uniform batch this is the per-row rule.
        """
        widest = max(ks)
        if widest == 0:
            return True
        batch, spec_rows = len(ks), sum(1 for k in ks if k)
        step = model.spec_step_time(batch, widest, self.topology, draft_rows=spec_rows)
        tokens = sum(expected_tokens_per_step(a, k) for a, k in zip(acceptances, ks))  # E_0 = 1: plain rows
        return tokens / step > batch / model.plain_time_per_token(batch)

    def _probe_affordable(self, model: CostModel, batch: int, a: float, k_max: int, remaining_tokens: int,
                          catch_up_tokens: int) -> bool:
        """Leaving K=0 makes the draft catch up on everything it skipped. Worth it only if that
        prefill would pay off were acceptance back, and (whether it is back is unknown) if it costs
        at most ``PROBE_BUDGET`` of the request's remaining plain decode time: after the plain
        steps of a long prompt the catch-up was ~30 ms against ~165 ms left."""
        catch_up_s = catch_up_tokens * model.costs.draft_prefill_s_per_token * batch
        budget = PROBE_BUDGET * remaining_tokens * model.plain_time_per_token(batch)
        return catch_up_s <= budget and self._pays_for_catch_up(
            model, batch, max(a, PROBE_CEILING), k_max, remaining_tokens, catch_up_tokens
        )

    def _pays_for_catch_up(self, model: CostModel, batch: int, a: float, k_max: int, remaining_tokens: int,
                           catch_up_tokens: int) -> bool:
        best = model.best_k(batch, a, k_max, self.topology)
        saving = remaining_tokens * (model.plain_time_per_token(batch) - best.time_per_token_s)
        # The catch-up prefill runs inside a batch step: every row of the batch waits for it.
        return saving > catch_up_tokens * model.costs.draft_prefill_s_per_token * batch

    def observe(self, cls: TrafficClass, proposed: int, accepted: int) -> None:
        self.tracker.observe(cls, proposed, accepted)

"""Adaptive K inside an engine: a state machine per request that re-chooses its K every step.

A request whose acceptance collapses drops to K=0 (plain decoding) without leaving its replica,
and climbs back when a probe shows that acceptance has returned.

Vocabulary (``costmodel.py``'s): a is the acceptance rate, K the draft tokens a step proposes,
E_K(a) = (1 - a^(K+1)) / (1 - a) the tokens a step emits (Leviathan et al. 2023). A request's a is
its own evidence (accepted / judged positions, the unbiased estimator of ``acceptance.py``) shrunk
towards its traffic class's estimate, which acts as a prior of ``prior_weight`` tokens. The priced
K is ``costmodel.adaptive_k`` (goodput-optimal K with hysteresis), priced by the ``CostView``
(``cost_view.py``: the costs of the request's sampling path at its context length, corrected by
the drift of real steps from the calibration), the same view the router prices with. A served
request carries the router's estimate for its class (``class_estimate``): it replaces this
engine's own, and the request starts at the K the router routed it with (the router priced that
start with the same view); from then on its own evidence decides. A *probe* is a step at
``PROBE_K`` after plain steps: at K=0 nothing is judged, so only a probe can show that acceptance
is back. The *probe wait* (``probe_every``) is how many plain steps pass before one is due; every
fall to plain doubles it (``max_probe_every`` at most), speculating beyond the probe's K resets it
to its base.

| from          | priced K               | to          | probe wait          | transition       |
|---------------|------------------------|-------------|---------------------|------------------|
| (first step)  | >= 1, pays its catch-up| SPECULATING | base                | ``start``        |
| (first step)  | otherwise              | PLAIN       | base                | ``start``        |
| PLAIN         | 0, no probe due        | PLAIN       | kept, steps + 1     | ``hold``         |
| PLAIN         | 0, probe due           | PLAIN       | kept, steps from 0  | ``decline_probe``|
| PLAIN         | PROBE_K                | PROBING     | kept                | ``probe``        |
| PLAIN         | > PROBE_K              | SPECULATING | base                | ``speculate``    |
| PROBING       | PROBE_K                | PROBING     | kept                | ``hold``         |
| PROBING       | > PROBE_K: succeeds    | SPECULATING | base                | ``speculate``    |
| PROBING       | 0: fails               | PLAIN       | doubled             | ``back_off``     |
| SPECULATING   | the same K             | SPECULATING | base                | ``hold``         |
| SPECULATING   | another K >= 1         | SPECULATING | base                | ``speculate``    |
| SPECULATING   | 0: collapse            | PLAIN       | doubled             | ``back_off``     |
| any, K >= 2   | regret over budget     | SPECULATING | base                | ``Regret.trip``  |
|               |                        |             |                     | K <= K // 2 on   |
| any, K = 1    | regret over budget     | STOPPED     | (K=0 to the end)    | ``stop``         |

The regret guard (``regret.py``) checks each request's speculative steps against measured plain
ones, whatever the costs priced; it halves a K that lost, then stops the request's speculation. Its
plain reference must be measured where the speculative steps are: a served replica shares its cores
with the router, the proxy and the other replicas, and every step there ran ~1.6x its idle
calibration; against the calibrated plain step each speculative step looked like a loss, and at
concurrency 4 auto requests stopped after 4-6 steps (65% of their steps plain, 0.91x of fixed K=4).
So where this engine has no recent plain step of its own at a batch bucket, the next step whose
speculating rows are all adaptive runs plain once, as a *reference step* (``reference_due``; every
``REFERENCE_EVERY`` speculative steps of the bucket after that).

Leaving PLAIN at PROBE_K is a probe whether the probe was due or a re-pricing found K=1 just worth
it: either way one step at K=1 tests whether acceptance is back. A plain request is re-priced every
``REPRICE_EVERY`` steps and when a probe is due; in between its priced K is 0. A plain request with
no judged tokens of its own runs on its traffic class's probe clock (``AdaptiveK.choose``). Each
row chooses as if the batch shared its K, so the engine runs the mix of the batch's K that gains
most (``batch_ks``): the rows' own, theirs with the plain rows lifted to a shared K, or plain. With
``budgeted`` one plan chooses every row's K for the batch instead (``step_planner.py``): no state
machine per row.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from specdec_core.acceptance import AcceptanceTracker, ProposalCoverage, TrafficClass, position_rates
from specdec_core.cost_view import CostView
from specdec_core.costmodel import PROBE_CEILING, CostModel, KChoice, adaptive_k, expected_tokens_per_step
from specdec_core.drift import StepDrift
from specdec_core.step_planner import StepBudget, plan_step, survival

REPRICE_EVERY = 4  # steps between re-pricings of a request at K=0
PROBE_BUDGET = 0.05  # share of a request's remaining decode time a probe's draft catch-up may take
PROBE_K = 1  # a probe's K: the cheapest step that judges a draft token
MEMO_SIZE = 256  # plain rows' prices kept per drift version (rows with evidence of their own each add one)
REFERENCE_EVERY = 64  # speculative steps at a batch bucket between two measured plain steps there (~1% of them)


class Phase(enum.Enum):
    SPECULATING = "speculating"  # K >= 1 as priced; the probe wait is at its base
    PLAIN = "plain"  # K = 0: the draft idles; a probe is due after probe_every steps
    PROBING = "probing"  # K = PROBE_K after plain steps, until K climbs (acceptance is back) or falls to 0
    STOPPED = "stopped"  # K = 0 to the end: the request's measured speculation lost over its budget


@dataclass(frozen=True)
class KState:
    phase: Phase
    k: int
    steps_at_current: int = 0  # steps since K last changed
    probe_every: int = 16  # the probe wait: steps at K=0 before a probe


def probe_due(state: KState) -> bool:
    return state.steps_at_current >= state.probe_every


def start(k: int, base_wait: int) -> KState:
    """A request's first decode step: speculating at a priced K, or plain."""
    return KState(Phase.SPECULATING, k, 0, base_wait) if k else KState(Phase.PLAIN, 0, 0, base_wait)


def hold(state: KState) -> KState:
    """The same K one more step."""
    # KState(...) rather than dataclasses.replace: this runs per row per step (replace was ~40% of it)
    return KState(state.phase, state.k, state.steps_at_current + 1, state.probe_every)


def decline_probe(state: KState) -> KState:
    """A due probe priced out (hopeless or unaffordable): wait another period rather than re-price
    it every step."""
    return KState(state.phase, state.k, 0, state.probe_every)


def probe(state: KState) -> KState:
    return KState(Phase.PROBING, PROBE_K, 0, state.probe_every)


def speculate(k: int, base_wait: int) -> KState:
    """Speculation at a K beyond the probe's shows acceptance is back: the probe wait returns to its base."""
    return KState(Phase.SPECULATING, k, 0, base_wait)


def back_off(state: KState, max_wait: int) -> KState:
    """Plain again, the next probe twice as far away: traffic where speculation keeps losing pays for
    fewer probes."""
    return KState(Phase.PLAIN, 0, 0, min(2 * state.probe_every, max_wait))


def stop(state: KState) -> KState:
    return KState(Phase.STOPPED, 0, 0, state.probe_every)


def next_state(state: KState, k: int, base_wait: int, max_wait: int) -> KState:
    """The transition a priced ``k`` makes from ``state`` (the module docstring's table)."""
    if state.phase is Phase.PLAIN:
        if k == 0:
            return decline_probe(state) if probe_due(state) else hold(state)
        return probe(state) if k == PROBE_K else speculate(k, base_wait)
    if k == 0:
        return back_off(state, max_wait)
    return hold(state) if k == state.k else speculate(k, base_wait)


def next_class_state(state: KState, clock: KState, k: int, base_wait: int, max_wait: int
                     ) -> tuple[KState, KState | None]:
    """A plain request without judged tokens of its own runs on its class's probe ``clock``:
    (the request's next state, the class's next clock; None when speculation resumes)."""
    if k == 0:
        return hold(state), next_state(clock, 0, base_wait, max_wait)
    if k == PROBE_K:  # the class's probe: the class's next one waits twice as long, whatever this one finds
        clock = back_off(clock, max_wait)
        return KState(Phase.PROBING, PROBE_K, 0, clock.probe_every), clock
    return speculate(k, base_wait), None


class AdaptiveK:
    def __init__(
        self,
        view: CostView,
        tracker: AcceptanceTracker,
        draft_name: str,
        topology: str = "colocated",
        probe_every: int = 16,
        max_probe_every: int = 256,
        budgeted: bool = False,
    ):
        self.view = view
        # Budgeted verification (``step_planner.py``): one plan per step chooses every adaptive row's K
        # for the batch as a whole, in place of each row's state machine and the padded batch's veto.
        self.budgeted = budgeted
        self.learns_drift = True  # False once the view prices with another owner's drift (``adopt_drift``)
        # This engine's own measured / calibrated step times, always learnt: the regret guard's reference.
        # No bounds: whatever the calibration, these are the steps the guard judges.
        self.measured = StepDrift(min_steps=1, bounds=(0.0, math.inf))
        self._since_plain: dict[int, int] = {}  # batch bucket -> speculative steps since its last plain step
        self.tracker = tracker
        self.draft_name = draft_name
        self.topology = topology
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self._class_clocks: dict[TrafficClass, KState] = {}  # probe clocks of plain requests without evidence
        self._plain_prices: dict[tuple, int] = {}  # ``_plain_k``'s memo, valid for drift version _memo_version
        self._memo_version = -1

    def traffic_class(self, temperature: float, domain: str) -> TrafficClass:
        return TrafficClass.of(self.draft_name, temperature, domain)

    def cost_model_for(self, cls: TrafficClass, context_len: int = 0) -> CostModel:
        return self.view.model_for(cls, context_len)

    def step_model(self, classes: list[TrafficClass], context_len: int = 0) -> CostModel:
        """What a step of these rows costs (``CostView.model_for_batch``): what it is planned and learnt at."""
        return self.view.model_for_batch(classes, context_len)

    def adopt_drift(self, drift) -> None:
        """Price with the router's drift (``StepDrift``), which it learns from served steps: one owner."""
        self.view.adopt(drift)
        self.learns_drift = False

    def acceptance(self, cls: TrafficClass, accepted: int, judged: int, class_estimate: float | None = None
                   ) -> float:
        """The request's own evidence shrunk towards its class's estimate (the router's, when given)."""
        prior = self.tracker.estimate(cls) if class_estimate is None else class_estimate
        return self.tracker.shrink(accepted, judged, prior)

    def choose(self, state: KState | None, cls: TrafficClass, accepted: int, judged: int, batch: int,
               k_max: int, remaining_tokens: int = 1 << 30, catch_up_tokens: int = 0, context_len: int = 0,
               class_estimate: float | None = None) -> KState:
        """A request's next state, whose ``k`` is its K this step; ``state`` None on its first decode step.

        ``catch_up_tokens`` is what the draft has not seen: the prompt on the first step, the tokens
        emitted during plain steps later. Speculation starts (or a probe runs) only if its saving
        over the remaining tokens can pay the draft's catch-up prefill (the prefill-heavy and
        long-context regimes); on the first step the saving is priced at the acceptance estimate,
        for a probe at ``PROBE_CEILING`` (could it pay if acceptance were back?) and within
        ``PROBE_BUDGET``.
        """
        if state is not None and state.phase is Phase.STOPPED:
            return hold(state)
        if state is None:
            a = self.acceptance(cls, accepted, judged, class_estimate)
            model = self.cost_model_for(cls, context_len)
            if class_estimate is not None:
                # Routed here to speculate by a router that priced the start with this view: start speculating.
                return start(model.best_k(batch, a, k_max, self.topology, allow_plain=False).k, self.probe_every)
            # As if at K=0: speculation must beat plain by the margin to start.
            k = adaptive_k(model, batch, a, k_max, 0, 0, self.topology, probe_every=self.probe_every,
                           probe_k=PROBE_K)
            pays = self._pays_for_catch_up(model, batch, a, k_max, remaining_tokens, catch_up_tokens)
            return start(k if pays else 0, self.probe_every)
        # A plain request with no judged tokens of its own knows only its class's estimate, so a probe
        # would test the class: it runs on the class's clock (one probe per probe_every plain
        # row-steps of the class, backing off across requests), not once per request.
        own = state.phase is not Phase.PLAIN or judged > 0
        clock = state if own else self._class_clocks.get(cls, KState(Phase.PLAIN, 0, 0, self.probe_every))
        k = self._price(state, clock, cls, (accepted, judged, class_estimate), batch, k_max, remaining_tokens,
                        catch_up_tokens, context_len)
        if k > PROBE_K:
            self._class_clocks.pop(cls, None)  # speculation pays: class probes restart at the base wait
        if own:
            return next_state(state, k, self.probe_every, self.max_probe_every)
        state, clock = next_class_state(state, clock, k, self.probe_every, self.max_probe_every)
        if clock is not None:
            self._class_clocks[cls] = clock
        return state

    def _price(self, state: KState, clock: KState, cls: TrafficClass, evidence: tuple[int, int, float | None],
               batch: int, k_max: int, remaining_tokens: int, catch_up_tokens: int, context_len: int) -> int:
        """This step's K from the cost model. At K=0 a request gains no evidence of its own and its other
        inputs (class estimate, drift, context) move slowly, so a plain request is priced only every
        ``REPRICE_EVERY`` steps and when a probe is due; in between its K is 0 (pricing is ~25 us a
        row: ~1% of a batch-1 step here, 2-3% at batch 4)."""
        plain = state.phase is Phase.PLAIN
        if plain and not probe_due(clock) and (state.steps_at_current + 1) % REPRICE_EVERY:
            return 0
        a = self.acceptance(cls, *evidence)
        model = self.cost_model_for(cls, context_len)
        if plain:
            k = self._plain_k(model, batch, a, k_max, probe_due(clock))
        else:
            k = adaptive_k(model, batch, a, k_max, state.k, clock.steps_at_current, self.topology,
                           probe_every=clock.probe_every, probe_k=PROBE_K)
        if not (plain and k > 0):
            return k
        return k if self._probe_affordable(model, batch, a, k_max, remaining_tokens, catch_up_tokens) else 0

    def _plain_k(self, model: CostModel, batch: int, a: float, k_max: int, due: bool) -> int:
        """``adaptive_k`` of a row at K=0, memoised while the drift stays put: a step's plain rows
        mostly share its inputs (one class estimate, one context bucket, the class's probe clock),
        and pricing them row by row was ~2% of a batch-32 step in which every row stayed plain."""
        if self._memo_version != self.view.drift.version or len(self._plain_prices) > MEMO_SIZE:
            self._plain_prices.clear()
            self._memo_version = self.view.drift.version
        key = (id(model), batch, a, k_max, due)  # the view keeps its models for its life: ids stay theirs
        k = self._plain_prices.get(key)
        if k is None:  # only whether a probe is due matters at K=0, not how long the row has waited
            k = self._plain_prices[key] = adaptive_k(model, batch, a, k_max, 0, int(due), self.topology,
                                                     probe_every=1, probe_k=PROBE_K)
        return k

    def observe_step(self, classes: list[TrafficClass], context_len: int, k: int, seconds: float) -> None:
        """A decode step whose rows (of ``classes``) all ran at K (K=0: plain) took ``seconds`` (propose + verify)."""
        calibrated = self.step_model(classes, context_len).calibrated_step_time(len(classes), k, self.topology)
        self._observe(k, len(classes), seconds, calibrated)

    def _observe(self, k: int, batch: int, seconds: float, calibrated: float) -> None:
        self.measured.observe(k, seconds, calibrated, batch)
        bucket = self.measured.bucket(batch)
        self._since_plain[bucket] = self._since_plain.get(bucket, 0) + 1 if k else 0
        if self.learns_drift:
            self.view.drift.observe(k, seconds, calibrated, batch)

    def reference_due(self, batch: int) -> bool:
        """Does the regret guard need a plain step of this engine's at this batch: none measured yet,
        or ``REFERENCE_EVERY`` speculative steps since the last one (the machine's load moves)."""
        return self._since_plain.get(self.measured.bucket(batch), REFERENCE_EVERY) >= REFERENCE_EVERY

    def plain_step_time(self, classes: list[TrafficClass], context_len: int) -> float:
        """A plain step of these rows as this engine measures it (the calibration until it has), priced as
        its measured steps were learnt (``step_model``: the rows' share of sampled ones, the step's context)."""
        batch = len(classes)
        calibrated = self.step_model(classes, context_len).calibrated_step_time(batch, 0, self.topology)
        seen = self.measured.buckets.get(self.measured.bucket(batch))
        return calibrated * (seen.plain if seen is not None and seen.plain_steps else 1.0)

    def batch_ks(self, ks: list[int], adaptive: list[bool], lift_caps: list[int], classes: list[TrafficClass],
                 evidence: list[tuple[int, int, float | None]], context_len: int) -> list[int]:
        """A step's K per row: the mix that emits the batch's tokens fastest (``mix_rate``) of the rows' own
        choices, those with the plain rows lifted to one shared K (each at most its ``lift_caps`` entry, 0:
        not liftable), and a plain step for the adaptive rows. Per row: whether it is adaptive, its class,
        its (accepted, judged, class estimate or None) evidence.

        Each row chose its K as if the batch shared it, so a row whose own acceptance priced it plain
        (a=0.7 where the batch's K=4 steps needed 0.75) made the mix a few rows' draft forwards over the
        whole batch's step, which lost to plain, and the batch ran plain: served at T=1 and batch 4 auto
        ran 48% of its steps plain (57% of them on this rule) where fixed K=4 measured 1.15x plain. In a
        memory-bound step a lifted row adds only its verify tokens and a draft row: the batch gains
        from it at an acceptance the row alone could not pay at."""
        speculating = {i for i, (on, k) in enumerate(zip(adaptive, ks)) if on and k > 0}
        if not speculating:
            return ks
        acceptances = [self.acceptance(cls, *row) for cls, row in zip(classes, evidence)]
        model = self.step_model(classes, context_len)
        lifts = [0 if k else cap for k, cap in zip(ks, lift_caps)]  # a row that speculates keeps its K
        mixes = [[0 if i in speculating else k for i, k in enumerate(ks)], ks]
        mixes += [[min(lift, depth) if lift else k for k, lift in zip(ks, lifts)] for depth in range(1, max(lifts) + 1)]
        return max(mixes, key=lambda mix: self.mix_rate(model, mix, acceptances))  # ties: the first, plain

    def mix_rate(self, model: CostModel, ks: list[int], acceptances: list[float]) -> float:
        """Tokens a step of this mix of K emits per second, as priced. Each row's draft tokens widen the
        step's one ragged verify (``runner.py``) and its draft forwards run over fewer rows than the
        batch; rows at K=0 emit one token, speculative rows E_K(a) on average."""
        if max(ks) == 0:
            return len(ks) / model.plain_time_per_token(len(ks))
        tokens = sum(expected_tokens_per_step(a, k) for a, k in zip(acceptances, ks))  # E_0 = 1: plain rows
        return tokens / model.ragged_step_time(len(ks), ks, self.topology)

    def plan_budget(self, classes: list[TrafficClass], evidence: list[tuple[list[int], list[int], float | None]],
                    k_maxes: list[int], fixed: list[int | None], context_len: int, plain_runs: list[int],
                    catch_up: list[int], remaining: list[int],
                    coverages: list[ProposalCoverage] | None = None) -> StepBudget:
        """A step's K per row under the step's cost (``step_planner.plan_step``). Per row: its class,
        its (accepted per position, judged per position, class estimate or None) evidence, its K cap,
        a K it keeps (None: planned), its steps since it last proposed. A row plain for
        ``probe_every`` steps (if its draft's catch-up is affordable, ``_probe_affordable``: a probe of a row
        whose draft has fallen far behind paid a whole prefill for one token's chance), or one of a class
        without evidence, probes: one draft token (``PROBE_K``) wherever the plan would speculate on it
        were its acceptance back (``PROBE_CEILING``, ``_probe_pays``), so that evidence can return where
        the plan would take it; where even that would not pay it stays plain. A batch is priced by
        its share of sampled rows (``step_model``). ``catch_up``: per row, the tokens the draft
        has not seen; beyond the one a speculative step feeds anyway, their prefill is charged to the
        row's first draft position, spread over its ``remaining`` tokens at its expected tokens per
        step (a new request pays for its prompt once, over the steps it speculates). ``coverages``: per
        row, how much of what it asked its proposer for came back (a lookup proposes only what followed
        its match): a position yields its survival, and costs its verify token, only as often as it is
        proposed (a probe asks as if it always were: it is there to find out)."""
        model = self.step_model(classes, context_len)
        batch = len(classes)
        priors: dict[tuple, list[float]] = {}  # a step's rows share a few classes: their rates once per plan
        probe_best: dict[int, KChoice] = {}  # by K cap: what a probe's row could save, once per plan
        survivals, coverage, probe_caps = [], [], {}  # probe_caps: a probing row's index -> its K cap
        coverages = coverages or [None] * len(classes)
        for cls, (acc, judged, estimate), k, f, run, cover, n, left in zip(
                classes, evidence, k_maxes, fixed, plain_runs, coverages, catch_up, remaining):
            due = f is None and k >= 1 and run >= self.probe_every
            if due and n > 1:  # as per request: the draft's catch-up must be cheap beside what it may save
                if k not in probe_best:
                    probe_best[k] = model.best_k(batch, PROBE_CEILING, k, self.topology)
                if not self._probe_affordable(model, batch, PROBE_CEILING, k, left, n - 1, probe_best[k]):
                    due, k = False, 0
            probe = due or (f is None and k >= 1 and self._unexplored(cls, judged, estimate))
            if f is not None or k < 1:
                survivals.append(())
            elif probe:
                survivals.append((PROBE_CEILING,))
                probe_caps[len(survivals) - 1] = k
            else:
                key = (cls, estimate, k)
                if key not in priors:
                    priors[key] = self.class_rates(cls, estimate, k)
                survivals.append(survival(position_rates(acc, judged, priors[key], self.tracker.prior_weight)))
            depth = len(survivals[-1])
            coverage.append([1.0] * depth if cover is None or probe else cover.rates(depth))
            survivals[-1] = tuple(x * c for x, c in zip(survivals[-1], coverage[-1]))  # what the asks yield
        per_token = model.costs.draft_prefill_s_per_token
        start_s = [(n - 1) * per_token * min(1.0, (1.0 + sum(s)) / max(1, left))
                   for n, left, s in zip(catch_up, remaining, survivals)]
        if probe_caps and self._probe_pays(model, survivals, fixed, start_s, probe_caps):
            fixed = [PROBE_K if i in probe_caps else f for i, f in enumerate(fixed)]
        return plan_step(model, survivals, fixed, self.topology, start_s=start_s, coverage=coverage,
                         unmeasured=lambda k: not self.view.drift.explored(k, batch, self.topology))

    def _probe_pays(self, model: CostModel, survivals: list, fixed: list[int | None], start_s: list[float],
                    probe_caps: dict[int, int]) -> bool:
        """Would the plan speculate on the probing rows were their acceptance back (``PROBE_CEILING`` at
        every position up to their caps)? Then they probe at ``PROBE_K`` whatever one draft token buys this
        step: as the per-request path asks it (``best_k`` at the ceiling). Priced at one token, a probe at
        batch 4 or more rarely beats the plan's margin, and a class that never probes never learns."""
        back = [survival([PROBE_CEILING] * probe_caps[i]) if i in probe_caps else s for i, s in enumerate(survivals)]
        plan = plan_step(model, back, fixed, self.topology, start_s=start_s)
        return any(plan.ks[i] for i in probe_caps)

    def _unexplored(self, cls: TrafficClass, judged: list[int], class_estimate: float | None) -> bool:
        """A row that knows nothing of its acceptance (no judged token, a class with less evidence
        than the prior's weight and no router estimate): its first plannable step is a probe."""
        return not judged and class_estimate is None and self.tracker.evidence(cls) < self.tracker.prior_weight

    def class_rates(self, cls: TrafficClass, class_estimate: float | None, k: int) -> list[float]:
        """[k] what a request's acceptance by draft position is shrunk towards: its class's (the
        router's estimate for the class, when given, at every position)."""
        return self.tracker.rates_by_position(cls, k) if class_estimate is None else [class_estimate] * k

    def observe_ragged_step(self, classes: list[TrafficClass], context_len: int, ks: list[int], seconds: float
                            ) -> None:
        """A decode step whose rows (of ``classes``) ran at their own K (a budgeted plan) took ``seconds``."""
        calibrated = self.step_model(classes, context_len).ragged_step_time(len(ks), ks, self.topology,
                                                                            calibrated=True)
        self._observe(max(ks), len(ks), seconds, calibrated)

    def _probe_affordable(self, model: CostModel, batch: int, a: float, k_max: int, remaining_tokens: int,
                          catch_up_tokens: int, best: KChoice | None = None) -> bool:
        """Leaving K=0 makes the draft catch up on everything it skipped. Worth it only if that
        prefill would pay off were acceptance back, and (whether it is back is unknown) if it costs
        at most ``PROBE_BUDGET`` of the request's remaining plain decode time: after the plain
        steps of a long prompt the catch-up was ~30 ms against ~165 ms left. ``best``: the best K at
        that acceptance, where the caller has it (a plan asks for every row of its batch)."""
        catch_up_s = catch_up_tokens * model.costs.draft_prefill_s_per_token * batch
        budget = PROBE_BUDGET * remaining_tokens * model.plain_time_per_token(batch)
        return catch_up_s <= budget and self._pays_for_catch_up(
            model, batch, max(a, PROBE_CEILING), k_max, remaining_tokens, catch_up_tokens, best
        )

    def _pays_for_catch_up(self, model: CostModel, batch: int, a: float, k_max: int, remaining_tokens: int,
                           catch_up_tokens: int, best: KChoice | None = None) -> bool:
        best = best or model.best_k(batch, a, k_max, self.topology)
        saving = remaining_tokens * (model.plain_time_per_token(batch) - best.time_per_token_s)
        # The catch-up prefill runs inside a batch step: every row of the batch waits for it.
        return saving > catch_up_tokens * model.costs.draft_prefill_s_per_token * batch

    def observe(self, cls: TrafficClass, proposed: int, accepted: int) -> None:
        self.tracker.observe(cls, proposed, accepted)

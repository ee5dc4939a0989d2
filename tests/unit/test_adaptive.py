"""Adaptive K in the engine: speculation where it pays, K=0 after an acceptance collapse, output
still lossless."""

import itertools
import time

import pytest

from specdec_core import AcceptanceTracker, AdaptiveK, Engine, StepCosts, TrafficClass
from specdec_core.adaptive import PROBE_K, KState, Phase, next_class_state, next_state, stop
from specdec_core.cost_view import CostView
from specdec_core.proposers.base import Proposal, ProposalRequest

# Synthetic costs shaped like docs/ARCHITECTURE.md's CPU table: a cheap draft, a verify ~1.5x a plain step at
# batch 1 and ~3.4x at batch 64.
COSTS = StepCosts(
    batches=(1, 64),
    qs=(1, 9),
    target_s=((0.0187, 0.0299), (0.11, 0.38)),
    draft_s=(0.0015, 0.006),
)
PROMPTS = ["It is a truth universally acknowledged", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def plain_reference(tiny_models):
    eng = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_model_len=256)
    return [o.token_ids for o in eng.generate(PROMPTS, max_new_tokens=40, mode="plain")]


class OracleDraft:
    """A draft that knows the plain output: every token it proposes is accepted, and it costs nothing.
    (The target as its own draft is aligned too, but it costs a target forward per draft token, so
    its speculation is near break-even and the regret guard, which measures real steps, may trip on
    a loaded machine.)"""

    name = "oracle"
    proposes_full_k = True

    def __init__(self, sequences: list[list[int]]):
        self.sequences = sequences  # [prompt + plain output] per prompt

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return [Proposal(self._continuation(r.token_ids, r.k), None) for r in requests]

    def _continuation(self, history: list[int], k: int) -> list[int]:
        full = next(s for s in self.sequences if s[:len(history)] == history)
        return full[len(history):len(history) + k]

    def release(self, seq_id: str) -> None:
        return None

    def num_sequences(self) -> int:
        return 0


def test_auto_speculates_with_an_aligned_draft(tiny_models, plain_reference):
    base = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_model_len=256)
    eng = base.sibling(OracleDraft([base.encode(p) + out for p, out in zip(PROMPTS, plain_reference)]))
    eng.enable_adaptive(COSTS)
    outs = eng.generate(PROMPTS, max_new_tokens=40, mode="auto", num_speculative_tokens=8)
    assert [o.token_ids for o in outs] == plain_reference
    assert all(o.stats.mean_acceptance_length > 3 for o in outs)


class SlowDraft:
    """The target as its own draft (every token accepted), 20 ms slower per proposal than it is: what
    a calibration that predates a slow draft host would not know."""

    def __init__(self, proposer):
        self.inner = proposer

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, requests):
        time.sleep(0.02)
        return self.inner.propose(requests)


def test_regret_guard_stops_speculation_that_measures_slower_than_plain(tiny_models, plain_reference):
    """The costs price every K as a win (a draft all of whose tokens are accepted); measured, each
    speculative step costs far more than this engine's own plain steps (its reference step) would
    for the tokens it emitted: the guard halves K, and once K=1 has lost too, stops speculation for
    the rest of the request (with the draft as fast as calibrated,
    test_auto_speculates_with_an_aligned_draft, it never trips)."""
    base = Engine.from_pretrained(tiny_models["target"], tiny_models["target"], max_model_len=256)
    eng = base.sibling(SlowDraft(base.proposer))
    eng.enable_adaptive(COSTS)
    outs = eng.generate(PROMPTS, max_new_tokens=40, mode="auto", num_speculative_tokens=8)
    assert [o.token_ids for o in outs] == plain_reference
    for o in outs:
        assert 1 <= o.stats.verify_steps <= 4 and o.stats.plain_steps > 25, o.stats
        # its plain decode steps say why: the guard stopped it (the costs priced every step as a win)
        causes = o.stats.plain_by_cause
        assert causes.get("stopped", 0) > 25 and not causes.get("priced") and not causes.get("batch"), causes
        assert sum(causes.values()) == o.stats.plain_steps - 1, (causes, o.stats)  # all but the prefill's pass


def test_a_stopped_request_stays_plain():
    policy, cls = collapsed_policy()
    state = stop(KState(Phase.SPECULATING, 4))
    for _ in range(5 * BASE):  # probes would have come due; acceptance (own evidence) is perfect
        state = policy.choose(state, cls, accepted=1000, judged=1000, batch=1, k_max=8)
        assert (state.phase, state.k) == (Phase.STOPPED, 0)


def test_auto_drops_to_plain_when_acceptance_collapses(tiny_models, plain_reference):
    eng = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_model_len=256)
    eng.enable_adaptive(COSTS)
    outs = eng.generate(PROMPTS, max_new_tokens=40, mode="auto", num_speculative_tokens=8)
    assert [o.token_ids for o in outs] == plain_reference
    for o in outs:
        # The random draft is almost never accepted: K falls from its first choice (2) towards 0-1, or
        # the regret guard (measured against this engine's own plain steps) stops it; most steps are plain.
        assert o.stats.proposed_per_position[0] >= 1
        assert o.stats.proposed / o.stats.verify_steps <= 2
        assert o.stats.plain_steps > o.stats.verify_steps
        # each plain decode step has its cause: the row's price, the batch's, the guard (no draft failed)
        causes = o.stats.plain_by_cause
        assert sum(causes.values()) == o.stats.plain_steps - 1 and "draft" not in causes, causes


def test_adaptive_k_is_plain_at_large_batch_for_moderate_acceptance():
    """a = 0.5: speculation pays at batch 1, not at batch 64 where a verify costs ~1.5-3.5x a step."""
    costs = StepCosts(
        batches=(1, 64), qs=(1, 2, 5, 9),
        target_s=((0.0187, 0.0195, 0.024, 0.0299), (0.11, 0.17, 0.26, 0.38)),
        draft_s=(0.0015, 0.006),
    )
    policy = AdaptiveK(CostView(costs), AcceptanceTracker(prior_mean=0.5), "draft")
    cls = policy.traffic_class(0.0, "default")
    assert policy.choose(None, cls, 0, 0, batch=1, k_max=8).k > 0
    assert policy.choose(None, cls, 0, 0, batch=64, k_max=8).k == 0
    # With its own evidence of a collapse, a request at batch 1 drops to plain too.
    assert policy.choose(None, cls, accepted=0, judged=200, batch=1, k_max=8).k == 0


# ---- the state machine: each transition of adaptive.py's table ----

BASE, MAX_WAIT = 4, 64


@pytest.mark.parametrize(
    "state, k, after",
    [
        pytest.param(KState(Phase.PLAIN, 0, 1, 8), 0, KState(Phase.PLAIN, 0, 2, 8), id="plain holds"),
        pytest.param(KState(Phase.PLAIN, 0, 8, 8), 0, KState(Phase.PLAIN, 0, 0, 8), id="due probe declined"),
        pytest.param(KState(Phase.PLAIN, 0, 8, 8), PROBE_K, KState(Phase.PROBING, PROBE_K, 0, 8), id="probe"),
        pytest.param(KState(Phase.PLAIN, 0, 3, 8), 4, KState(Phase.SPECULATING, 4, 0, BASE), id="plain resumes"),
        pytest.param(KState(Phase.PROBING, 1, 0, 8), 1, KState(Phase.PROBING, 1, 1, 8), id="probe continues"),
        pytest.param(KState(Phase.PROBING, 1, 2, 8), 4, KState(Phase.SPECULATING, 4, 0, BASE), id="probe succeeds"),
        pytest.param(KState(Phase.PROBING, 1, 2, 8), 0, KState(Phase.PLAIN, 0, 0, 16), id="probe fails"),
        pytest.param(KState(Phase.PROBING, 1, 0, 48), 0, KState(Phase.PLAIN, 0, 0, MAX_WAIT), id="wait capped"),
        pytest.param(KState(Phase.SPECULATING, 4, 2, BASE), 4, KState(Phase.SPECULATING, 4, 3, BASE),
                     id="speculating holds"),
        pytest.param(KState(Phase.SPECULATING, 4, 2, BASE), 1, KState(Phase.SPECULATING, 1, 0, BASE),
                     id="speculating re-chooses"),
        pytest.param(KState(Phase.SPECULATING, 4, 2, BASE), 0, KState(Phase.PLAIN, 0, 0, 2 * BASE), id="collapse"),
    ],
)
def test_transition_table(state, k, after):
    assert next_state(state, k, BASE, MAX_WAIT) == after


def test_class_clock_transitions():
    """A plain request without evidence of its own steps on its class's clock: the class's probe
    backs the clock off before its outcome is known; speculation beyond a probe drops the clock."""
    request, clock = KState(Phase.PLAIN, 0, 2, BASE), KState(Phase.PLAIN, 0, 3, 8)
    assert next_class_state(request, clock, 0, BASE, MAX_WAIT) == (
        KState(Phase.PLAIN, 0, 3, BASE), KState(Phase.PLAIN, 0, 4, 8))
    assert next_class_state(request, KState(Phase.PLAIN, 0, 8, 8), 0, BASE, MAX_WAIT)[1] == KState(
        Phase.PLAIN, 0, 0, 8)  # the class's due probe declined
    assert next_class_state(request, clock, PROBE_K, BASE, MAX_WAIT) == (
        KState(Phase.PROBING, PROBE_K, 0, 16), KState(Phase.PLAIN, 0, 0, 16))
    assert next_class_state(request, clock, 4, BASE, MAX_WAIT) == (KState(Phase.SPECULATING, 4, 0, BASE), None)


def collapsed_policy(**kw) -> tuple[AdaptiveK, TrafficClass]:
    policy = AdaptiveK(CostView(COSTS), AcceptanceTracker(prior_mean=0.05), "draft", probe_every=BASE, **kw)
    return policy, policy.traffic_class(0.0, "default")


BACK, GONE = {"accepted": 390, "judged": 400}, {"accepted": 0, "judged": 400}  # own evidence: acceptance back / gone


def test_collapse_falls_to_plain_with_doubled_wait():
    policy, cls = collapsed_policy()
    state = policy.choose(None, cls, **BACK, batch=1, k_max=8)
    assert state.phase is Phase.SPECULATING and state.k > PROBE_K and state.probe_every == BASE
    state = policy.choose(state, cls, **GONE, batch=1, k_max=8)
    assert state == KState(Phase.PLAIN, 0, 0, 2 * BASE)


def test_plain_holds_until_a_probe_is_due_then_probes():
    policy, cls = collapsed_policy()
    state = KState(Phase.PLAIN, 0, 0, BASE)
    for steps in range(1, BASE + 1):
        state = policy.choose(state, cls, **GONE, batch=1, k_max=8)
        assert state == KState(Phase.PLAIN, 0, steps, BASE)
    state = policy.choose(state, cls, **GONE, batch=1, k_max=8)  # due
    assert state == KState(Phase.PROBING, PROBE_K, 0, BASE)


def test_probe_succeeds_to_speculating_at_base_wait():
    policy, cls = collapsed_policy()
    state = policy.choose(KState(Phase.PROBING, PROBE_K, 0, 32), cls, **BACK, batch=1, k_max=8)
    assert state.phase is Phase.SPECULATING and state.k > PROBE_K and state.probe_every == BASE


def test_probe_fails_to_plain_with_doubled_wait():
    policy, cls = collapsed_policy(max_probe_every=48)
    state = policy.choose(KState(Phase.PROBING, PROBE_K, 0, 16), cls, **GONE, batch=1, k_max=8)
    assert state == KState(Phase.PLAIN, 0, 0, 32)
    state = policy.choose(KState(Phase.PROBING, PROBE_K, 0, 32), cls, **GONE, batch=1, k_max=8)
    assert state == KState(Phase.PLAIN, 0, 0, 48)  # at most max_probe_every


def test_request_without_evidence_probes_when_its_class_is_due():
    """No judged tokens of its own: the class's clock (BASE plain row-steps) makes the probe due, and
    the class's next probe waits twice as long."""
    policy, cls = collapsed_policy()
    state = policy.choose(None, cls, 0, 0, batch=1, k_max=8)
    assert state.phase is Phase.PLAIN
    for _ in range(BASE):
        state = policy.choose(state, cls, 0, 0, batch=1, k_max=8)
        assert state.phase is Phase.PLAIN
    assert policy._class_clocks[cls] == KState(Phase.PLAIN, 0, BASE, BASE)
    state = policy.choose(state, cls, 0, 0, batch=1, k_max=8)
    assert state == KState(Phase.PROBING, PROBE_K, 0, 2 * BASE)
    assert policy._class_clocks[cls] == KState(Phase.PLAIN, 0, 0, 2 * BASE)


def test_auto_needs_enable_adaptive(tiny_models):
    eng = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_model_len=256)
    with pytest.raises(ValueError, match="enable_adaptive"):
        eng.generate(PROMPTS, mode="auto")


def test_prefill_heavy_request_starts_plain():
    """A long prompt with a short output cannot amortise the draft's prefill; a long output can."""
    costs = StepCosts(batches=(1,), qs=(1, 5), target_s=((0.0187, 0.024),), draft_s=(0.0015,),
                      draft_prefill_s_per_token=0.0004)
    policy = AdaptiveK(CostView(costs), AcceptanceTracker(prior_mean=0.7), "draft")
    cls = policy.traffic_class(0.0, "default")
    assert policy.choose(None, cls, 0, 0, batch=1, k_max=4, remaining_tokens=4, catch_up_tokens=500).k == 0
    assert policy.choose(None, cls, 0, 0, batch=1, k_max=4, remaining_tokens=500, catch_up_tokens=500).k > 0


def test_failed_probes_back_off_and_speculation_resets_the_interval():
    policy = AdaptiveK(CostView(COSTS), AcceptanceTracker(prior_mean=0.05), "draft", probe_every=4)
    cls = policy.traffic_class(0.0, "default")
    state = policy.choose(None, cls, accepted=0, judged=400, batch=1, k_max=8)
    phases, waits = [], []
    for _ in range(40):  # acceptance stays collapsed: every probe fails
        state = policy.choose(state, cls, accepted=0, judged=400, batch=1, k_max=8)
        phases.append(state.phase)
        waits.append(state.probe_every)
    probes = [i for i, phase in enumerate(phases) if phase is Phase.PROBING]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(probes) >= 2 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # probes thin out
    assert max(waits) > 4
    # Acceptance returns: the next probe climbs past K=1 and the interval is back at its base.
    state = policy.choose(KState(Phase.PROBING, 1, 0, max(waits)), cls, accepted=390, judged=400, batch=1, k_max=8)
    assert state.phase is Phase.SPECULATING and state.k > 1 and state.probe_every == 4


def test_requests_without_evidence_probe_on_their_class_schedule():
    """Short requests of a class where speculation does not pay start at K=0 with no judged tokens of
    their own: a probe would test the class, so the class probes, not every request, and its probes
    back off across requests. Once one request speculates beyond K=1, the class's wait is back at base."""
    policy = AdaptiveK(CostView(COSTS), AcceptanceTracker(prior_mean=0.05), "draft", probe_every=4)
    cls = policy.traffic_class(0.0, "default")
    probes_at = []
    for request in range(20):  # 20 requests x 10 decode steps
        state = policy.choose(None, cls, 0, 0, batch=1, k_max=8)
        judged = 0
        for step in range(10):
            judged += state.k  # the last step judged its proposals (all rejected)
            state = policy.choose(state, cls, accepted=0, judged=judged, batch=1, k_max=8)
            if state.k:
                probes_at.append(request * 10 + step)
    gaps = [b - a for a, b in itertools.pairwise(probes_at)]
    assert 2 <= len(probes_at) <= 8  # once per request would be 20
    assert gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0]
    # Acceptance is back: a request that speculates at K > 1 resets the class's wait.
    policy.choose(KState(Phase.PROBING, 1, 0, 4), cls, accepted=390, judged=400, batch=1, k_max=8)
    assert cls not in policy._class_clocks


def test_plain_requests_are_repriced_every_few_steps():
    """At K=0 a request is re-priced every REPRICE_EVERY steps (its inputs move slowly), so a rise in
    acceptance starts speculation within that many steps, not on the very next one."""
    from specdec_core.adaptive import REPRICE_EVERY

    policy = AdaptiveK(CostView(COSTS), AcceptanceTracker(prior_mean=0.05), "draft", probe_every=64)
    cls = policy.traffic_class(0.0, "default")
    kw = dict(accepted=390, judged=400, batch=1, k_max=8)  # evidence says speculation pays now
    assert policy.choose(KState(Phase.PLAIN, 0, 0, 64), cls, **kw).k == 0  # between re-pricings
    assert policy.choose(KState(Phase.PLAIN, 0, REPRICE_EVERY - 1, 64), cls, **kw).k > 0


def test_a_plain_requests_price_follows_the_drift():
    """Plain rows' prices are memoised (``_plain_k``), but only while the drift stays put: once real
    steps show speculation at 1.9x its calibration and plain at 0.6x, the same request re-priced
    stays plain."""
    from specdec_core.adaptive import REPRICE_EVERY

    policy = AdaptiveK(CostView(COSTS), AcceptanceTracker(prior_mean=0.5), "draft", probe_every=64)
    cls = policy.traffic_class(0.0, "default")
    repriced = KState(Phase.PLAIN, 0, REPRICE_EVERY - 1, 64)
    kw = dict(accepted=300, judged=400, batch=1, k_max=8)
    assert policy.choose(repriced, cls, **kw).k > 0
    for _ in range(25):
        policy.view.drift.observe(0, 0.6, 1.0, batch=1)
        policy.view.drift.observe(4, 1.9, 1.0, batch=1)
    assert policy.choose(repriced, cls, **kw).k == 0


def test_probe_waits_when_the_draft_catch_up_cannot_pay():
    """Long context: after plain steps the draft is hundreds of tokens behind; a probe would pay that
    prefill for a handful of remaining tokens, so it is skipped; with few tokens to catch up it runs."""
    costs = StepCosts(batches=COSTS.batches, qs=COSTS.qs, target_s=COSTS.target_s, draft_s=COSTS.draft_s,
                      draft_prefill_s_per_token=0.001)
    policy = AdaptiveK(CostView(costs), AcceptanceTracker(prior_mean=0.05), "draft", probe_every=4)
    cls = policy.traffic_class(0.0, "default")
    state = KState(Phase.PLAIN, 0, steps_at_current=10, probe_every=4)  # a probe is due
    kw = dict(accepted=0, judged=400, batch=1, k_max=8, remaining_tokens=8)
    declined = policy.choose(state, cls, catch_up_tokens=600, **kw)
    assert declined.phase is Phase.PLAIN
    # A declined probe waits another period instead of being re-priced every step.
    assert declined.steps_at_current == 0 and declined.probe_every == 4
    assert policy.choose(state, cls, catch_up_tokens=2, **kw).phase is Phase.PROBING


def test_probe_after_a_long_prompt_stays_within_budget():
    """The draft skipped a 550-token prompt: a probe would spend more than PROBE_BUDGET of the
    remaining decode time on the catch-up even though it could pay off at acceptance 0.95."""
    costs = StepCosts(batches=COSTS.batches, qs=COSTS.qs, target_s=COSTS.target_s, draft_s=COSTS.draft_s,
                      draft_prefill_s_per_token=5e-5)
    policy = AdaptiveK(CostView(costs), AcceptanceTracker(prior_mean=0.05), "draft", probe_every=4)
    cls = policy.traffic_class(0.0, "default")
    state = KState(Phase.PLAIN, 0, steps_at_current=10, probe_every=4)
    kw = dict(accepted=0, judged=400, batch=1, k_max=8, remaining_tokens=48)
    assert policy.choose(state, cls, catch_up_tokens=16, **kw).k == 1  # 0.8 ms of ~900 ms: probe
    # 200 ms: would pay off at acceptance 0.95 (~0.5 s saved), but is over 5% of the ~0.9 s left
    assert policy._pays_for_catch_up(policy.view.model(True), 1, 0.95, 8, 48, 4000)
    assert policy.choose(state, cls, catch_up_tokens=4000, **kw).k == 0


def test_a_mix_is_priced_as_the_ragged_batch():
    """At batch 8 with a cheap draft, every row speculating at high acceptance beats a plain step, and so
    does one row at K=4 among plain rows: the ragged verify widens by its 4 tokens, not every row's to 5.
    Rows that accept 10% do not pay for theirs."""
    policy = AdaptiveK(CostView(COSTS), AcceptanceTracker(), "draft")
    model = policy.view.model(True)

    def beats_plain(ks, acceptances):
        return policy.mix_rate(model, ks, acceptances) > policy.mix_rate(model, [0] * 8, acceptances)

    assert beats_plain([4] * 8, [0.9] * 8)
    assert beats_plain([4] + [0] * 7, [0.9] * 8)
    assert not beats_plain([4] * 8, [0.1] * 8)
    padded = model.spec_step_time(8, 4, draft_rows=1)
    assert model.ragged_step_time(8, [4] + [0] * 7) < 0.75 * padded


def test_the_batch_lifts_rows_that_priced_themselves_plain_where_the_step_gains():
    """Served at T=1 and batch 4, rows whose own acceptance priced them plain left a few rows' draft
    forwards over the whole step, the mix lost to plain and the batch ran plain, where fixed K=4
    measured 1.15x plain. In a memory-bound step a lifted row adds only verify tokens and a draft row:
    rows at 0.6 ride along with rows at 0.9. Rows at 0.02 do not (their verify tokens buy nothing), a
    row that may not be lifted (cap 0: its draft failed) stays plain, and a batch whose
    speculation pays in no mix runs plain."""
    memory_bound = StepCosts(batches=(1, 16), qs=(1, 9), target_s=((0.010, 0.011), (0.012, 0.016)),
                             draft_s=(0.0005, 0.001))
    policy = AdaptiveK(CostView(memory_bound), AcceptanceTracker(), "draft")
    cls = policy.traffic_class(1.0, "default")

    def mix(ks, acceptances, caps=(4, 4, 4, 4)):
        return policy.batch_ks(ks, [True] * 4, list(caps), [cls] * 4, [(0, 0, a) for a in acceptances], 64)

    lifted = mix([2, 2, 0, 0], [0.9, 0.9, 0.6, 0.6])
    assert lifted[:2] == [2, 2] and min(lifted[2:]) >= 1
    model = policy.cost_model_for(cls, 64)
    rates = [policy.mix_rate(model, ks, [0.9, 0.9, 0.6, 0.6]) for ks in ([2, 2, 0, 0], lifted, [0] * 4)]
    assert rates[1] > rates[0] > rates[2]
    assert mix([2, 2, 0, 0], [0.9, 0.9, 0.6, 0.6], caps=(4, 4, 0, 4))[2] == 0
    costly = AdaptiveK(CostView(COSTS), AcceptanceTracker(), "draft")  # verify tokens cost: compute bound
    assert costly.batch_ks([2, 2, 0, 0], [True] * 4, [4] * 4, [cls] * 4,
                           [(0, 0, a) for a in (0.9, 0.9, 0.02, 0.02)], 64) == [2, 2, 0, 0]
    assert mix([1, 0, 0, 0], [0.05] * 4) == [0] * 4

"""The regret guard (``specdec_core/regret.py`` ``Regret``): a request's speculative steps charged
against plain ones, tripping only beyond its steps' chance; a tripped guard halves K, then stops."""

import pytest
import torch

from specdec_core.adaptive import KState, Phase, stop
from specdec_core.regret import Regret

BASE = 4  # a probe interval (the tests only carry it through a trip)


def test_regret_charges_speculative_steps_against_plain_ones():
    r = Regret()  # steps at K=1: each step's outcome (1 or 2 tokens) adds 1/4 to the variance
    assert not r.charge(0.020, 2, 1, 0.010, 2)  # 2 tokens for 2 plain steps' time: no loss
    assert not r.charge(0.025, 2, 1, 0.010, 4)  # half a plain step lost: under the floor of 4 plain steps
    assert r.loss == pytest.approx(0.5)
    for n in range(5, 8):  # a step with one token at 2x: one plain step lost each
        assert not r.charge(0.020, 1, 1, 0.010, n)
    assert r.charge(0.020, 1, 1, 0.010, 8) and r.loss == pytest.approx(4.5)  # over 4 plain steps, and z sigma = 2.2
    deep = Regret()  # at K=8 chance alone spans 9 tokens a step: z sigma after 5 steps is 2 * 4 * sqrt(5) = 17.9
    assert not any(deep.charge(0.030, 1, 8, 0.010, n) for n in range(1, 6)) and deep.loss == pytest.approx(10)
    long = Regret()  # 2000 tokens in: the budget is 3% of 2000 plain steps, not the floor
    assert not long.charge(0.5, 1, 1, 0.010, 2000) and long.charge(0.2, 1, 1, 0.010, 2001)
    assert stop(KState(Phase.SPECULATING, 4)).phase is Phase.STOPPED


def regret_trips(gain: float, acceptance: float, k: int, steps: int, requests: int, seed: int) -> float:
    """Share of ``requests`` whose guard trips within ``steps`` steps at K=``k``: each step emits what a
    draft at ``acceptance`` gets accepted (the accepted prefix, then one more token) and costs what makes
    speculation ``gain`` times faster than plain on average."""
    gen = torch.Generator().manual_seed(seed)
    mean_tokens = (1 - acceptance ** (k + 1)) / (1 - acceptance)
    step_s = mean_tokens / gain * 0.010  # plain: 10 ms a token
    tripped = 0
    for _ in range(requests):
        r, tokens = Regret(), 0
        accepted = torch.rand(steps, k, generator=gen) < acceptance  # [steps, k]
        for row in accepted:
            emitted = int(row.int().cumprod(0).sum()) + 1
            tokens += emitted
            if r.charge(step_s, emitted, k, 0.010, tokens):
                tripped += 1
                break
    return tripped / requests


def test_regret_does_not_decline_thin_wins_on_their_spread_and_trips_gross_losses_within_a_few_steps():
    """Served at batch 4, K=4 won by 6-10% and the guard still ran 78% of auto's steps plain: a step
    rejected at once costs more than a plain step and emits one token, and one accepted whole emits five,
    so the loss walks past a fixed floor on noise. A guard that trips only beyond its steps' spread
    leaves such requests speculating (a fixed floor of 4 plain steps tripped 29% of them within a
    48-token request at an 8% gain, 50% at break-even), and still stops a prose request whose class
    estimate put it at K=4 while its text accepts 0.2 of the draft."""
    assert regret_trips(gain=1.08, acceptance=0.75, k=4, steps=16, requests=400, seed=0) < 0.03
    assert regret_trips(gain=1.0, acceptance=0.75, k=4, steps=16, requests=400, seed=1) < 0.05
    # Priced at 0.81 (K=4's cost for 3.3 tokens), accepting 0.2: ~2.6x plain's time per token.
    gross = regret_trips(gain=(1 - 0.2 ** 5) / 0.8 / 3.3, acceptance=0.2, k=4, steps=8, requests=400, seed=2)
    assert gross > 0.95


def test_a_tripped_guard_halves_k_with_a_fresh_budget_then_stops():
    """A K too large for the request's text, not speculation itself, may be what lost: K=5 that
    lost its budget goes on at K<=2, then K<=1, each with a fresh budget; K=1 that lost stops."""
    r = Regret(loss=5.0, variance=9.0)
    state = r.trip(KState(Phase.SPECULATING, 5, 7, BASE))
    assert (state.phase, state.k, r.k_cap, r.loss, r.variance) == (Phase.SPECULATING, 2, 2, 0.0, 0.0)
    r.loss = 5.0
    assert (r.trip(state).k, r.k_cap) == (1, 1)
    assert r.trip(KState(Phase.PROBING, 1)).phase is Phase.STOPPED
    at_one = Regret()  # a request that started at K=1 and lost: a batch that speculates may still lift it to K=1
    assert at_one.trip(KState(Phase.SPECULATING, 1)).phase is Phase.STOPPED and at_one.k_cap == 1


def test_a_row_pays_its_share_of_a_mixed_step():
    """A K=1 row among K=2 rows (draft tokens 2, 2, 2, 1: 1.75 a row) pays a plain step plus 1/1.75 of
    the step's time beyond it, not the whole step: charged the K=2 rows' draft tokens too, a row that
    emitted its two tokens every step lost 0.4 plain steps a step."""
    whole, share = Regret(), Regret()
    for n in range(1, 21):
        whole.charge(0.0140, 2, 1, 0.0100, 2 * n)
        share.charge(0.0140, 2, 1, 0.0100, 2 * n, share=1 / 1.75)
    assert whole.loss == pytest.approx(20 * (1.4 - 2))  # two tokens still beat 1.4 plain steps...
    assert share.loss == pytest.approx(20 * (1 + 0.4 / 1.75 - 2))  # ... by more at its share
    # 1.5 tokens a step at 1.8 plain steps' time: a loss at the whole step, a gain at its share
    whole, share = Regret(), Regret()
    assert any(whole.charge(0.0180, 1 + n % 2, 1, 0.0100, n) for n in range(1, 41))
    assert not any(share.charge(0.0180, 1 + n % 2, 1, 0.0100, n, share=1 / 1.75) for n in range(1, 41))

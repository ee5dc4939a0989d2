"""The regret guard (in the spirit of SmartSpec, Liu et al. 2024): a request's measured speculation
against plain decoding, whatever the costs priced. Pure: no I/O, no torch.

Vocabulary (``costmodel.py``'s, Leviathan et al. 2023): a step at K proposes K draft tokens and emits
the accepted ones plus one recovered or bonus token, 1 to K+1 in all. A request keeps the measured wall
time of the steps it speculated in against what plain steps at the same batch would have taken for the
tokens those steps emitted (the engine's own measured plain steps, not the calibration: ``adaptive.py``'s
reference step). Once that loss passes ``REGRET_BUDGET`` of the request's time so far (and a few steps'
worth, and what its steps' spread would sum to by chance), the request's K is capped at half the K that
lost, with a fresh budget; once K=1 has lost too, it decodes plain to its end (``adaptive.Phase.STOPPED``;
a batch that speculates may still lift it to K=1: ``AdaptiveK.batch_ks``). So a wrong calibration costs a
request at most a few budgets against plain, and a K too large for the request's text (a class estimate of
0.81 started a prose request at K=4 whose first steps accepted 0.2 of their tokens; stopped there, it took
0.91x plain's time where K=2 took 0.75x) costs one budget rather than its whole speculation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdec_core.adaptive import PROBE_K, KState, Phase, stop

REGRET_BUDGET = 0.03  # a request's speculation may cost at most this share of its plain-equivalent time
REGRET_FLOOR_STEPS = 4  # ... and never trips on less than this many plain steps' worth of loss
REGRET_Z = 2.0  # ... nor on a loss within this many standard deviations of its steps' chance (``Regret``)


@dataclass
class Regret:
    """One request's regret guard: the measured time of its speculative steps minus what plain steps
    would have taken for the tokens they emitted (``loss``, in plain steps), against the plain-equivalent
    time of all its tokens so far. Only speculative steps are charged: a plain row costs nothing to watch.

    The loss is a random walk: a step rejected at its first position costs more than a plain step and
    emits one token, one accepted whole emits K+1. So it trips only once the loss is also ``REGRET_Z``
    standard deviations of what its steps could sum to by chance (a one-sided sequential test), with
    each step's variance bounded by its range of outcomes, 1 to K+1 tokens: (K/2)^2 (Popoviciu). At K=4
    with a 6-10% mean gain, the spread alone crossed a fixed floor of 4 plain steps within ~15 steps, and
    the guard declined winning speculation on noise (served, batch 4: 78% of auto's steps plain in one
    run, 10% in the next). A gross loss (a class estimate of 0.81 for text that accepts 0.2) still trips
    within a few steps; a thin one is left to the evidence across requests (the drift)."""

    loss: float = 0.0
    variance: float = 0.0  # the bound on the summed loss's variance, in plain steps squared
    k_cap: int | None = None  # the largest K the request may still use (None: its own K)

    def charge(self, spec_step_s: float, emitted: int, proposed: int, plain_step_s: float,
               tokens_so_far: int, share: float = 1.0) -> bool:
        """One speculative step that proposed ``proposed`` tokens; True once the loss is over the budget
        and beyond chance. The row pays a plain step plus ``share`` of the step's time beyond it: its
        draft tokens over the step's mean per row (1 in a uniform step). Charged the whole step, a K=1
        row among K=2 rows paid for their draft tokens too, and its guard stopped it."""
        self.loss += (plain_step_s + share * (spec_step_s - plain_step_s)) / plain_step_s - emitted
        self.variance += (proposed / 2) ** 2
        budget = max(REGRET_BUDGET * tokens_so_far, REGRET_FLOOR_STEPS, REGRET_Z * math.sqrt(self.variance))
        return self.loss > budget

    def trip(self, state: KState) -> KState:
        """The budget is spent speculating at ``state.k``: at most half that K from now on, with a
        fresh budget, or plain to the end once K = ``PROBE_K`` lost too."""
        if state.k <= PROBE_K:
            self.k_cap = PROBE_K  # what a batch may still lift the stopped row to (``AdaptiveK.batch_ks``)
            return stop(state)
        self.k_cap, self.loss, self.variance = max(PROBE_K, state.k // 2), 0.0, 0.0
        return KState(Phase.SPECULATING, self.k_cap, 0, state.probe_every)

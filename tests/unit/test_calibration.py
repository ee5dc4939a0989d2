"""Calibration (``specdec_core/calibration.py``): a cost grid measured through the engine's own steps."""


import dataclasses

import pytest

from specdec_core import Engine, NgramProposer, calibration
from specdec_core.calibration import calibrate


def test_calibrate_measures_a_cost_grid(tiny_models):
    eng = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_model_len=256, max_batch_size=4)
    costs = calibrate(eng, batches=(1, 4), qs=(1, 3))
    assert costs.batches == (1, 4) and costs.qs == (1, 3)
    assert all(t > 0 for row in costs.target_s for t in row) and all(t > 0 for t in costs.draft_s)
    assert eng.target.num_free_slots == 4


def test_calibration_keeps_each_cells_fastest_sweep(tiny_models, monkeypatch):
    """A burst of noise over a run of cells in one sweep (another replica loading beside this one)
    does not reach the grid: each cell keeps its fastest of two sweeps. In one sweep it would."""
    eng = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_model_len=256, max_batch_size=4)
    real, calls = calibration._time_steps, []

    def bursty(engine, batch, k, *args, **kwargs):
        verify, propose = real(engine, batch, k, *args, **kwargs)
        calls.append(k)
        return (verify + 1.0, propose + 1.0) if len(calls) <= 3 and k > 0 else (verify, propose)

    monkeypatch.setattr(calibration, "_time_steps", bursty)
    costs = calibrate(eng, batches=(1,), qs=(1, 2, 3))
    assert max(costs.target_s[0]) < 0.5 and costs.draft_time(1) < 0.5
    calls.clear()
    one = calibrate(eng, batches=(1,), qs=(1, 2, 3), sweeps=1)
    assert one.target_time(1, 2) > 1.0 and one.target_time(1, 1) < 0.5


def test_ngram_calibration_times_full_width_verifies(tiny_models):
    """The lookup finds nothing to propose on the synthetic prompt's continuation; calibration must
    still time K+1-token verifies, not plain steps labelled K+1."""
    eng = Engine.from_pretrained(tiny_models["target"], proposer="ngram", max_model_len=256)
    widths = set()
    verify = eng.verifier.verify

    def recording_verify(items):  # the real verify, recording how many draft tokens each row judged
        widths.update(len(item.proposal.token_ids) for item in items)
        return verify(items)

    eng.verifier.verify = recording_verify
    calibrate(eng, batches=(1,), qs=(1, 9), steps=5)
    assert 8 in widths  # q = 9: K = 8 draft tokens verified, not plain steps labelled K+1
    assert isinstance(eng.proposer, NgramProposer)  # restored


def test_calibration_times_a_packed_verify_against_the_uniform_one_of_its_tokens(tiny_models, monkeypatch):
    """``StepCosts.ragged_s``: per batch, a verify with half the rows at K and half plain, less the grid's
    uniform verify of the same tokens (nothing at batch 1, where rows cannot differ)."""
    eng = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_model_len=256, max_batch_size=4)
    real, packed = calibration._time_steps, []

    def timed(engine, batch, k, *args, ks=None, **kwargs):
        verify, propose = real(engine, batch, k, *args, ks=ks, **kwargs)
        if ks is not None and list(ks) == [2, 2, 0, 0]:
            packed.append(batch)
            return 1.0, propose  # a packed verify of 1 s: the surcharge is what the grid does not explain
        return verify, propose

    monkeypatch.setattr(calibration, "_time_steps", timed)
    costs = calibrate(eng, batches=(1, 4), qs=(1, 3))
    assert packed == [4, 4]  # the fastest of two sweeps
    assert costs.ragged_s[0] == 0.0
    assert costs.ragged_s[1] == pytest.approx(1.0 - costs.ragged_target_time(4, 4))


def test_context_slopes_keep_each_timings_fastest_sweep(tiny_models, monkeypatch):
    """Each long-context timing keeps its fastest of two sweeps, as the grid's cells do: a burst of
    noise over one does not become a slope (it priced batch 2 at context 256 1.6x what its steps
    took). In one sweep it would."""
    eng = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_model_len=256, max_batch_size=4)
    real, long_calls = calibration._time_steps, []

    def bursty(engine, batch, k, context_len, *args, **kwargs):
        verify, propose = real(engine, batch, k, context_len, *args, **kwargs)
        if context_len == 128:
            long_calls.append(k)
            if len(long_calls) == 1:
                return verify + 1.0, propose + 1.0
        return verify, propose

    monkeypatch.setattr(calibration, "_time_steps", bursty)
    costs = calibrate(eng, batches=(1,), qs=(1, 3), long_context_len=128)
    assert long_calls == [0, 2, 0, 2]  # the narrowest and widest verify, twice
    assert costs.context_slope_s[0][0] < 1.0 / 64 / 2  # the burst, spread over 64 tokens, would be 1/64 s a token
    long_calls.clear()
    one = calibrate(eng, batches=(1,), qs=(1, 3), long_context_len=128, sweeps=1)
    assert one.context_slope_s[0][0] > 1.0 / 64 * 0.9


def test_the_grid_is_timed_after_the_cold_steps_that_follow_a_prefill(tiny_models, monkeypatch):
    """The first decode steps after a prefill run slow while the caches fill again (10-11 ms against 6.0 at
    batch 8 on an Intel host): the grid times the steps after ``WARMUP_STEPS`` of them, as a served batch
    runs. Timed from the first steps, it priced batch-8 steps 1.5x what they took served."""
    eng = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_model_len=256, max_batch_size=4)
    step, since_prefill = eng.step, [0]

    def cold_after_prefill():  # the real step; the five after a prefill take a second more
        step()
        since_prefill[0] = 0 if eng.last_step.prefill_rows else since_prefill[0] + 1
        if 1 <= since_prefill[0] <= 5:
            eng.last_step = dataclasses.replace(eng.last_step, verify_s=eng.last_step.verify_s + 1.0)

    monkeypatch.setattr(eng, "step", cold_after_prefill)
    costs = calibrate(eng, batches=(1, 4), qs=(1, 3))
    assert max(t for row in costs.target_s for t in row) < 0.5

"""Cost model against hand-computed cases (Leviathan et al. 2023, Theorem 3.8 / Corollary 3.9)."""

import json
import math
from dataclasses import replace

import pytest

from specdec_bench.predict import load_shape
from specdec_core.calibration import cost_grid, fit_draft_cost
from specdec_core.costmodel import (
    CostModel,
    StepCosts,
    adaptive_k,
    expected_tokens_per_step,
    leviathan_speedup,
)
from specdec_core.roofline import (
    A100,
    COMPUTE_EFFICIENCY,
    H100,
    H200,
    MEMORY_EFFICIENCY,
    VLLM,
    ModelShape,
    forward_time,
    roofline_costs,
)

llama3_8b = load_shape("llama-3-8b.json")
llama32_1b = load_shape("llama-3.2-1b.json")


def leviathan_costs(c: float, hop: float = 0.0) -> StepCosts:
    """Theorem 3.8's world: verify of any length costs one plain step (1 s), draft c s, flat in batch."""
    return StepCosts(
        batches=(1, 64),
        qs=(1, 9),
        target_s=((1.0, 1.0), (1.0, 1.0)),
        draft_s=(c, c),
        hop_overhead_s={"colocated": 0.0, "separate": hop},
    )


def cpu_costs() -> StepCosts:
    """docs/ARCHITECTURE.md (Facts) measurements (17M target, 1.9M draft), seconds; q=9 row measured, q=1 too."""
    return StepCosts(
        batches=(1, 8, 32, 128),
        qs=(1, 9),
        target_s=((0.0187, 0.0299), (0.0311, 0.0633), (0.0648, 0.207), (0.161, 0.548)),
        draft_s=(0.0057, 0.0086, 0.0114, 0.0232),
        hop_overhead_s={"colocated": 0.0, "separate": 0.016},
    )


def test_expected_tokens_hand_cases():
    assert expected_tokens_per_step(0.5, 0) == 1.0
    assert expected_tokens_per_step(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens_per_step(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(0.999999, 4) == pytest.approx(5.0, rel=1e-5)
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.2, 2)


def test_leviathan_at_zero_cost_is_expected_tokens():
    for a in (0.3, 0.6, 0.9):
        for k in (1, 4, 8):
            assert leviathan_speedup(a, 0.0, k) == pytest.approx(expected_tokens_per_step(a, k))


@pytest.mark.parametrize("a,c", [(0.6, 0.5), (0.6, 0.7), (0.3, 0.2), (0.3, 0.4), (0.9, 0.85)])
def test_k1_speedup_iff_a_above_c(a, c):
    # K=1: (1 + a) / (1 + c) > 1 iff a > c (Corollary 3.9)
    assert (leviathan_speedup(a, c, 1) > 1) == (a > c)
    cm = CostModel(leviathan_costs(c))
    assert cm.spec_time_per_token(1, 1, a) == pytest.approx(1.0 / leviathan_speedup(a, c, 1))


def test_cost_model_reduces_to_leviathan():
    cm = CostModel(leviathan_costs(0.1))
    choice = cm.best_k(1, 0.8, k_max=8)
    expected = max(range(1, 9), key=lambda k: leviathan_speedup(0.8, 0.1, k))
    assert choice.k == expected
    assert choice.predicted_speedup == pytest.approx(leviathan_speedup(0.8, 0.1, expected))


def test_best_k_is_zero_when_nothing_beats_plain():
    cm = CostModel(leviathan_costs(0.9))
    choice = cm.best_k(1, 0.8)
    assert choice.k == 0
    assert choice.predicted_speedup == 1.0
    forced = cm.best_k(1, 0.8, allow_plain=False)
    assert forced.k >= 1 and forced.predicted_speedup < 1.0


def test_cost_ratio_and_hops():
    cm = CostModel(cpu_costs())
    assert cm.cost_ratio(1) == pytest.approx(0.0057 / 0.0187)
    assert cm.spec_step_time(1, 2, "separate") - cm.spec_step_time(1, 2, "colocated") == pytest.approx(0.016)
    with pytest.raises(ValueError):
        cm.spec_step_time(1, 2, "teleport")


def test_overlapped_round_priced_by_hand():
    """PEARL's post-verify in Theorem 3.8's world: draft D = K c, verify V = 1 s, hop h. A round
    costs max(D, V) + (1 - a^K) D + h and emits E_K(a) - a^K tokens (a kept round drops its bonus)."""
    a, k, c, h = 0.8, 4, 0.25, 0.1
    cm = CostModel(leviathan_costs(c, hop=h))
    d, kept, e = k * c, a**k, expected_tokens_per_step(a, k)
    overlapped = (max(d, 1.0) + (1 - kept) * d + h) / (e - kept)
    sequential = (d + 1.0 + h) / e
    assert cm.overlapped_time_per_token(1, k, a) == pytest.approx(overlapped)
    assert cm.overlap_pays(1, k, a) == (overlapped < sequential)
    assert cm.spec_time_per_token(1, k, a, "separate") == pytest.approx(min(overlapped, sequential))
    assert cm.spec_time_per_token(1, k, a, "colocated") == pytest.approx((d + 1.0) / e)  # no overlap there
    never = CostModel(replace(leviathan_costs(c, hop=h), overlapped=()))
    assert never.spec_time_per_token(1, k, a, "separate") == pytest.approx(sequential)


def test_overlap_pays_only_for_a_costly_draft_whose_proposals_are_accepted_whole():
    assert CostModel(leviathan_costs(0.25)).overlap_pays(1, 4, 0.9)  # D = V: the round hides the draft
    # low acceptance: most overlapped proposals are dropped, and their draft time delays the next round
    assert not CostModel(leviathan_costs(0.5)).overlap_pays(1, 4, 0.3)
    # a cheap draft has little to hide, and a kept round gives up its bonus token
    assert not CostModel(leviathan_costs(0.01)).overlap_pays(1, 4, 0.9)
    # K = 1: an overlapped round emits one token whatever happens
    assert not CostModel(leviathan_costs(0.25)).overlap_pays(1, 1, 0.99)


def test_interpolation_and_extrapolation():
    costs = cpu_costs()
    assert costs.target_time(8, 1) == pytest.approx(0.0311)
    assert costs.target_time(8, 5) == pytest.approx((0.0311 + 0.0633) / 2)  # halfway in q
    assert costs.target_time(20, 1) == pytest.approx((0.0311 + 0.0648) / 2)  # halfway in batch
    assert costs.draft_time(256) == pytest.approx(0.0232 + (0.0232 - 0.0114) / 96 * 128)  # from the last two
    assert costs.target_time(1, 17) == pytest.approx(0.0299 + (0.0299 - 0.0187))
    assert costs.draft_time(0.5) == pytest.approx(0.0057)  # flat below the grid


def test_break_even_batch_on_cpu_measurements():
    cm = CostModel(cpu_costs())
    a, k = 0.45, 1  # weak pair: pays at batch 1, not once the verify's extra row-token costs show
    b = cm.break_even_batch(a, k)
    assert b is not None and 8 < b < 128
    assert cm.spec_time_per_token(b - 1, k, a) < cm.plain_time_per_token(b - 1)
    assert cm.spec_time_per_token(b, k, a) >= cm.plain_time_per_token(b)
    # the separate topology's hops move break-even down (or make it lose at once)
    assert cm.break_even_batch(a, k, "separate") <= b
    assert CostModel(leviathan_costs(0.05)).break_even_batch(0.9, 2) is None


def test_roundtrip_json():
    costs = cpu_costs()
    again = StepCosts.from_dict(json.loads(json.dumps(costs.to_dict())))
    assert again == costs


def test_validation():
    with pytest.raises(ValueError):
        StepCosts(batches=(2, 1), qs=(1,), target_s=((1.0,), (1.0,)), draft_s=(0.1, 0.1))
    with pytest.raises(ValueError):
        StepCosts(batches=(1,), qs=(1, 2), target_s=((1.0,),), draft_s=(0.1,))


def test_cost_grid_calls_every_grid_point():
    calls = []

    def time_target(b, q):
        calls.append((b, q))
        return 0.01 * b + 0.001 * q

    costs = cost_grid(time_target, lambda b: 0.002 * b, batches=(1, 4), qs=(1, 3), hop_overhead_s={"colocated": 0.0})
    assert calls == [(1, 1), (1, 3), (4, 1), (4, 3)]
    assert costs.target_time(4, 3) == pytest.approx(0.043)
    assert costs.draft_time(4) == pytest.approx(0.008)
    assert cost_grid(time_target, None, batches=(1,), qs=(1,)).draft_s == (0.0,)


def test_draft_phase_is_affine_in_k():
    """A step's draft phase measured here: propose(K) ~ 0.45 + 0.85 K ms (its first forward also feeds
    the last verify's tokens). The fit recovers both terms, so K=1 is not undercharged; a fit below
    zero (noise) falls back to cost per token; the step cost enters spec_step_time once per step."""
    per_token, per_step = fit_draft_cost([(k, 0.45 + 0.85 * k) for k in (1, 2, 4, 8)])
    assert per_token == pytest.approx(0.85) and per_step == pytest.approx(0.45)
    assert fit_draft_cost([(1, 1.0), (4, 4.4)]) == (pytest.approx((1.0 + 4 * 4.4) / 17), 0.0)
    assert fit_draft_cost([(4, 2.0)]) == (0.5, 0.0)
    costs = StepCosts(batches=(1,), qs=(1, 9), target_s=((1.0, 1.0),), draft_s=(0.2,), draft_step_s=(0.1,),
                      hop_overhead_s={"colocated": 0.0})
    cm = CostModel(costs)
    assert cm.spec_step_time(1, 1) == pytest.approx(1.0 + 0.2 + 0.1)
    assert cm.spec_step_time(1, 4) == pytest.approx(1.0 + 0.8 + 0.1)
    assert cm.plain_time_per_token(1) == pytest.approx(1.0)
    assert StepCosts.from_dict(costs.to_dict()) == costs


def test_cost_grid_caps_noise_spikes_by_larger_shapes():
    """A spike at (b=1, q=2) above the q=5 measurement is noise: it is capped, the rest kept."""
    measured = {(1, 1): 2.0, (1, 2): 4.0, (1, 5): 3.0, (8, 1): 1.5, (8, 2): 5.0, (8, 5): 6.0}
    costs = cost_grid(lambda b, q: measured[b, q], {1: 0.9, 8: 0.8}.get, batches=(1, 8), qs=(1, 2, 5))
    assert costs.target_s == ((1.5, 3.0, 3.0), (1.5, 5.0, 6.0))
    assert costs.draft_s == (0.8, 0.8)


def test_roofline_batch1_decode_streams_the_weights_once():
    """Batch-1 decode: the per-layer launch cost plus the streamed weights at the derated bandwidth;
    one token's compute and 128 tokens of KV add ~1%."""
    weights = llama3_8b.streamed_params * 2
    t = forward_time(llama3_8b, H200, tokens=1, rows=1, context_len=128)
    launch = llama3_8b.num_layers * VLLM.per_layer_s
    assert weights / 4.8e12 == pytest.approx(3.13e-3, rel=0.01)  # ~15 GB streamed (embedding table aside)
    assert t - launch == pytest.approx(weights / (MEMORY_EFFICIENCY * 4.8e12), rel=0.02)


def test_roofline_verify_tokens_cost_compute_at_every_batch():
    """Additive, not max(memory, compute): a K+1-token verify costs K more tokens of compute even at
    batch 1, where a roofline max() would call them free."""
    def extra(batch, q):
        return (forward_time(llama3_8b, H100, batch * q, batch, 128)
                - forward_time(llama3_8b, H100, batch, batch, 128))

    per_token = 2 * llama3_8b.streamed_params / (COMPUTE_EFFICIENCY * 989e12)
    assert extra(1, 4) == pytest.approx(3 * per_token, rel=0.02)
    assert extra(256, 9) == pytest.approx(256 * 8 * per_token, rel=0.02)


def test_roofline_depth_tp_and_dtype():
    deep = ModelShape(1e9, 64, 1024, 16, 8, 64, 32000, tied_embeddings=True)
    shallow = ModelShape(1e9, 8, 2048, 16, 8, 128, 32000, tied_embeddings=True)
    assert forward_time(deep, H100, 1, 1, 0) - forward_time(shallow, H100, 1, 1, 0) == pytest.approx(
        56 * VLLM.per_layer_s)  # same weights, 8x the layers: small deep drafts are not cheap
    one, four = (forward_time(llama3_8b, H100, 1, 1, 128, tp=tp) for tp in (1, 4))
    launch = llama3_8b.num_layers * VLLM.per_layer_s  # every GPU launches every layer
    all_reduce = 2 * llama3_8b.num_layers * VLLM.all_reduce_s  # 64 of them
    assert four - launch - all_reduce == pytest.approx((one - launch) / 4, rel=0.01)  # a quarter per GPU
    bf16, fp8 = (forward_time(llama3_8b, H100, 1, 1, 0, dtype=d) for d in ("bf16", "fp8"))
    assert fp8 - launch == pytest.approx((bf16 - launch) / 2, rel=0.01)  # half the bytes, twice the FLOP rate
    assert forward_time(llama3_8b, A100, 1024, 1, 0, dtype="fp8") > forward_time(llama3_8b, A100, 1024, 1, 0) / 2


def test_roofline_presets_are_derated_alike():
    """Same efficiencies for every device: step-time ratios follow the datasheet ratios."""
    def memory_part(device):
        return forward_time(llama3_8b, device, 1, 1, 0) - llama3_8b.num_layers * VLLM.per_layer_s

    assert memory_part(H100) / memory_part(H200) == pytest.approx(4.8 / 3.35, rel=0.01)


def test_roofline_costs_answer_cost_model_questions():
    cm = CostModel(roofline_costs(llama3_8b, llama32_1b, H100, context_len=512))
    assert cm.costs.source == "roofline:H100"
    assert 0.2 < cm.cost_ratio(1) < 0.4  # 1.24B vs 8B, plus the proposer's per-pass work
    assert cm.best_k(1, 0.8).k > 0  # batch-1 decode is memory bound: speculation pays
    grid = {"batches": (1, 64, 512, 1024)}
    short = CostModel(roofline_costs(llama3_8b, llama32_1b, H100, context_len=128, **grid))
    assert short.best_k(1024, 0.3).k == 0  # verify tokens cost compute: low acceptance loses
    assert short.spec_time_per_token(1024, 3, 0.6) > short.plain_time_per_token(1024)  # fixed K=3 slows down
    long = CostModel(roofline_costs(llama3_8b, llama32_1b, H100, context_len=4096, **grid))
    # KV reads dominate both models' steps and the draft's cache is 4x smaller (MagicDec)
    assert long.best_k(1024, 0.6).predicted_speedup > short.best_k(1024, 0.6).predicted_speedup
    assert short.costs.at_context(4096).target_time(64, 4) == pytest.approx(long.costs.target_time(64, 4))
    assert short.costs.at_context(4096).draft_time(64) == pytest.approx(long.costs.draft_time(64))


def test_model_shape_from_hf_config_matches_preset():
    cfg = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    shape = ModelShape.from_hf_config(cfg)
    assert shape.num_params == pytest.approx(8.03e9, rel=0.01)  # Llama-3-8B
    assert shape == llama3_8b
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (32, 8, 128)
    assert shape.dtype == "bf16"
    assert shape.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2


def test_model_shape_from_transformers_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=1000, tie_word_embeddings=True,
    )
    shape = ModelShape.from_hf_config(cfg)
    model = transformers.LlamaForCausalLM(cfg)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert shape.num_params == sum(p.numel() for p in model.parameters()) - norms
    assert shape.head_dim == 16


def test_adaptive_k_drops_to_plain_and_recovers_with_probe():
    cm = CostModel(cpu_costs())
    kw = dict(cost_model=cm, batch=1, k_max=8, probe_every=4, probe_k=1)
    k = adaptive_k(acceptance=0.8, current_k=0, **kw)
    assert k > 0
    assert adaptive_k(acceptance=0.05, current_k=k, **kw) == 0  # collapse: plain step in place
    assert [adaptive_k(acceptance=0.05, current_k=0, steps_at_current=s, **kw) for s in range(6)] == [0] * 4 + [1, 1]
    assert adaptive_k(acceptance=0.05, current_k=1, **kw) == 0  # probe failed: back to plain
    assert adaptive_k(acceptance=0.8, current_k=1, **kw) > 1  # probe found acceptance back


def test_adaptive_k_never_probes_where_no_k_can_pay():
    """An expensive draft (c = 0.97): even at a = 0.95 no K beats plain (Corollary 3.9), so a probe would only cost
    the draft's catch-up; a cheap draft at the same collapsed acceptance is probed."""
    kw = dict(batch=1, acceptance=0.05, k_max=8, current_k=0, steps_at_current=100, probe_every=4)
    assert adaptive_k(CostModel(leviathan_costs(0.97)), **kw) == 0
    assert adaptive_k(CostModel(leviathan_costs(0.05)), **kw) == 1


def test_adaptive_k_hysteresis_keeps_near_ties():
    cm = CostModel(leviathan_costs(0.1))
    best = cm.best_k(1, 0.8).k
    for other in (best - 1, best + 1):
        ratio = cm.spec_time_per_token(1, best, 0.8) / cm.spec_time_per_token(1, other, 0.8)
        assert ratio > 0.95  # neighbours are within the hysteresis band here
        assert adaptive_k(cm, 1, 0.8, 8, current_k=other) == other
    assert adaptive_k(cm, 1, 0.8, 8, current_k=8, hysteresis=0.0) == best
    assert math.isclose(adaptive_k(cm, 1, 0.8, 2, current_k=5), cm.best_k(1, 0.8, 2).k)


def test_adaptive_k_leaves_plain_only_for_a_gain_beyond_the_margin():
    """c = 0.45, verify = 1 plain step: at a = 0.5 the best K (1) is 3.4% faster than plain, within
    the 5% margin. A K that loses to plain (K=4, or a probe) does not move to that marginal K but
    drops to plain; at a = 0.7 (K=1: 17% faster) it moves."""
    cm = CostModel(leviathan_costs(0.45))
    assert cm.best_k(1, 0.5).k == 1 and 1.0 < cm.best_k(1, 0.5).predicted_speedup < 1.05
    assert adaptive_k(cm, 1, 0.5, 8, current_k=4) == 0
    assert adaptive_k(cm, 1, 0.5, 8, current_k=0) == 0
    assert adaptive_k(cm, 1, 0.7, 8, current_k=4) == cm.best_k(1, 0.7).k > 0
    assert adaptive_k(cm, 1, 0.7, 8, current_k=0) == cm.best_k(1, 0.7).k


def test_context_slopes_price_long_contexts_per_row():
    costs = StepCosts(batches=(1, 4), qs=(1, 5), target_s=((1.0, 1.5), (2.0, 4.0)), draft_s=(0.3, 0.5),
                      context_len=64, context_slope_s=(0.001, 0.004), draft_context_slope_s=0.0005)
    assert costs.at_context(32) is costs  # never cheaper than the measured context
    long = costs.at_context(564)  # 500 tokens more per row
    assert [list(r) for r in long.target_s] == [pytest.approx([1.5, 3.5]), pytest.approx([4.0, 12.0])]
    assert long.draft_s == pytest.approx((0.55, 1.5))
    assert StepCosts.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    # Verify reads the context K+1 times: long contexts move the break-even towards plain.
    cm, cm_long = CostModel(costs), CostModel(long)
    assert cm.best_k(1, 0.8, 4).predicted_speedup > cm_long.best_k(1, 0.8, 4).predicted_speedup

"""Matmul kernels of the lean layer stack: same result as ``F.linear`` at every token count, and the
HF modules keep reading the same memory."""

import pytest
import torch
import torch.nn.functional as F

from specdec_core.fused_llama import share_weight
from specdec_core.linear import PACKED_MAX_ROWS, Projection, winning_band


@pytest.mark.parametrize("band", ["measure", None, range(3, PACKED_MAX_ROWS + 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 64, 100])
def test_projection_matches_linear(rows, band):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 48, generator=gen)
    proj = Projection(weight, packed_band=band)
    x = torch.randn(2, rows, 48, generator=gen)[:1]
    torch.testing.assert_close(proj(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_the_packed_kernel_runs_only_inside_its_band(monkeypatch):
    from specdec_core import linear

    calls = []
    real = linear._packed
    monkeypatch.setattr(linear, "_packed", lambda x, packed: calls.append(x.shape[0]) or real(x, packed))
    proj = Projection(torch.randn(8, 4), packed_band=range(3, 17))
    if proj.packed is None:
        pytest.skip("no oneDNN in this torch build")
    for rows in (1, 2, 3, 16, 17, 64):
        proj(torch.randn(rows, 4))
    assert calls == [3, 16]
    assert Projection(torch.randn(8, 4), packed_band=None).packed is None  # no second copy of the weight


def test_the_band_is_the_longest_run_where_packed_wins_by_the_margin():
    rows = (3, 4, 8, 16, 32, 64)
    plain = [10.0] * 6
    assert winning_band(rows, plain, [20, 20, 20, 20, 20, 20]) is None  # the Xeon host: never
    assert winning_band(rows, plain, [10, 5, 5, 5, 9, 12]) == range(4, 17)  # a near tie (9 of 10) keeps x @ W^T
    assert winning_band(rows, plain, [5, 12, 5, 5, 5, 12]) == range(8, 33)
    assert winning_band(rows, plain, [5] * 6) == range(3, 65)


def test_modules_share_the_projection_memory():
    q, k = torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(8, 4, bias=False)
    expected = torch.cat([q.weight, k.weight]).detach().clone()
    proj = Projection(torch.cat([q.weight, k.weight]))
    share_weight(proj, (q, k))
    torch.testing.assert_close(torch.cat([q.weight, k.weight]), expected)
    x = torch.randn(3, 8)
    torch.testing.assert_close(torch.cat([q(x), k(x)], -1), proj(x), rtol=1e-5, atol=1e-5)
    proj.weight_t.zero_()  # one storage: the modules see the change
    assert q.weight.abs().sum() == 0 and k.weight.abs().sum() == 0


def test_a_probe_reads_its_weight_from_where_the_models_forward_does():
    """The copies a probe cycles through span the model's weights (capped past any cache): a model
    that fits a cache is probed cache-hot, one that does not is probed from memory."""
    from specdec_core.linear import MAX_COLD_COPIES, MAX_PROBE_SET_BYTES, _cold_copies

    weight = 4 << 20
    assert _cold_copies(weight, model_bytes=14 << 20) == 4  # the tiny family: its forward stays in a cache
    assert _cold_copies(weight, model_bytes=528 << 20) == 132  # a target larger than a 300 MiB cache
    assert _cold_copies(weight, model_bytes=1 << 40) * weight == MAX_PROBE_SET_BYTES  # a 1 TB model: the cap
    assert _cold_copies(weight, model_bytes=0) == 1
    assert _cold_copies(1 << 10, model_bytes=528 << 20) == MAX_COLD_COPIES


def test_the_runner_probes_each_projection_on_its_models_weight_bytes(monkeypatch, tiny_models):
    from specdec_core import linear
    from specdec_core.runner import ModelRunner

    probed = []
    monkeypatch.setattr(linear, "packed_rows", lambda *shape: probed.append(shape) or None)
    runner = ModelRunner.from_pretrained(tiny_models["target"], device="cpu", max_slots=1, max_len=16)
    if not linear._prepack_supported(runner.model.lm_head.weight):
        pytest.skip("no oneDNN in this torch build")
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert len(probed) == 4 * runner.model.config.num_hidden_layers + 1  # every projection and the lm head
    assert {shape[-1] for shape in probed} == {weight_bytes}


def test_the_runner_reports_the_band_each_projection_probed(monkeypatch, tiny_models):
    """``ModelRunner.kernel_bands``: what each projection's probe chose in this process (the engine process
    logs it at start), by projection."""
    from specdec_core import linear
    from specdec_core.runner import ModelRunner

    def band(in_features, out_features, *_):  # one band per shape, so that a projection reported as another fails
        return range(1, 2 + (7 * in_features + out_features) % 61)

    monkeypatch.setattr(linear, "packed_rows", band)
    runner = ModelRunner.from_pretrained(tiny_models["target"], device="cpu", max_slots=1, max_len=16)
    if not linear._prepack_supported(runner.model.lm_head.weight):
        pytest.skip("no oneDNN in this torch build")
    _, qkv, o_proj, _, gate_up, down = runner._fused.layers[0]
    reported = runner.kernel_bands()
    assert set(reported) == {"qkv", "o_proj", "gate_up", "down", "lm_head"}
    for name, proj in (("qkv", qkv), ("o_proj", o_proj), ("gate_up", gate_up), ("down", down),
                       ("lm_head", runner._lm_head)):
        out_features, in_features = proj.weight.shape
        assert reported[name] == band(in_features, out_features), name
    assert len(set(reported.values())) > 1  # the shapes' bands differ: a mix-up would show

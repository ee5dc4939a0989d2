"""Matmul kernels of the lean layer stack: same result as ``F.linear`` at every token count, and the
HF modules keep reading the same memory."""

import pytest
import torch
import torch.nn.functional as F

from specdec_core.fused_llama import share_weight
from specdec_core.linear import PREPACKED_MIN_ROWS, Projection


@pytest.mark.parametrize("rows", [1, 2, PREPACKED_MIN_ROWS, 5, 16, 64])
def test_projection_matches_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 48, generator=gen)
    proj = Projection(weight)
    x = torch.randn(2, rows, 48, generator=gen)[:1]
    torch.testing.assert_close(proj(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


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

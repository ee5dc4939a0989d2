"""Rejection sampler (Leviathan et al. 2023, Algorithm 1): hand-built cases, the distribution test,
determinism and input validation."""

import pytest
import torch

from specdec_core.sampling import greedy_verify, process_logits, rejection_sample


def one_hot(idx, vocab):
    return torch.nn.functional.one_hot(torch.tensor(idx), vocab).float()


def test_greedy_accepts_matching_prefix_then_recovers_target_argmax():
    vocab = 5
    draft_ids = torch.tensor([[1, 2, 3]])
    q = one_hot([[1, 2, 3]], vocab)
    p = one_hot([[1, 2, 4, 0]], vocab)  # target agrees on 2 tokens, then wants 4
    assert rejection_sample(draft_ids, q, p).tolist() == [[1, 2, 4, -1]]


def test_greedy_all_accepted_adds_bonus_token():
    vocab = 6
    draft_ids = torch.tensor([[3, 3], [1, 0]])
    q = one_hot([[3, 3], [1, 0]], vocab)
    p = one_hot([[3, 3, 5], [2, 0, 4]], vocab)
    assert rejection_sample(draft_ids, q, p).tolist() == [[3, 3, 5], [2, -1, -1]]


@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_greedy_verify_is_the_one_hot_limit_of_rejection_sampling(k):
    gen = torch.Generator().manual_seed(k)
    vocab, batch = 7, 64
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    best = logits.argmax(-1)
    # Drafts that agree with the target's argmax for a random number of positions, then guess.
    draft = torch.where(torch.rand(batch, k, generator=gen) < 0.7, best[:, :k], torch.randint(0, vocab, (batch, k)))
    expected = rejection_sample(draft, torch.nn.functional.one_hot(draft, vocab).float(),
                                process_logits(logits, torch.zeros(batch)))
    assert greedy_verify(draft, logits) == [row[row >= 0].tolist() for row in expected]


def test_zero_target_probability_is_never_accepted_and_recovery_excludes_draft_token():
    draft_ids = torch.tensor([[0]])
    q = torch.tensor([[[0.5, 0.5, 0.0]]])
    p = torch.tensor([[[0.0, 0.3, 0.7], [1.0, 0.0, 0.0]]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        out = rejection_sample(draft_ids, q, p, gen)
        assert out[0, 0].item() in (1, 2) and out[0, 1].item() == -1


def test_k_zero_samples_from_target():
    p = one_hot([[[2]]], 4).view(1, 1, 4)
    out = rejection_sample(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, 4), p)
    assert out.tolist() == [[2]]


def _first_token_histogram(q, p, k, n, gen):
    """Sample n times; return the histogram of the first emitted token."""
    vocab = p.shape[-1]
    qk = q.expand(n, k, vocab)
    pk = p.expand(n, k + 1, vocab)
    cdf = qk[:, 0].cumsum(-1)
    draft = torch.searchsorted(cdf, torch.rand(n, 1, generator=gen), right=True).clamp(max=vocab - 1)
    rest = torch.multinomial(qk[:, 1:].reshape(-1, vocab), 1, generator=gen).view(n, k - 1) if k > 1 else None
    ids = draft if rest is None else torch.cat([draft, rest], dim=1)
    out = rejection_sample(ids, qk, pk, gen)
    return torch.bincount(out[:, 0], minlength=vocab).float() / n


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft_kind", ["far", "equal"])
def test_output_follows_target_distribution(k, draft_kind):
    """Total-variation distance to the target shrinks with the sample count (vLLM's test idea)."""
    vocab = 20
    gen = torch.Generator().manual_seed(1234 + k)
    p = torch.softmax(torch.randn(1, 1, vocab, generator=gen) * 2, -1).expand(1, k + 1, vocab)
    if draft_kind == "equal":
        q = p[:, :k]
    else:
        q = torch.softmax(torch.randn(1, 1, vocab, generator=gen) * 3, -1).expand(1, k, vocab)
    distances = []
    for n in (100, 1_000, 100_000):
        hist = _first_token_histogram(q, p, k, n, gen)
        distances.append(0.5 * (hist - p[0, 0]).abs().sum().item())
    assert distances[2] < distances[0]
    assert distances[2] < 0.01, distances


def test_every_emitted_position_follows_target_when_draft_is_far():
    """Second token (conditioned on acceptance of the first, independent positions) also follows p."""
    vocab, k, n = 8, 2, 100_000
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(1, k + 1, vocab, generator=gen), -1)
    q = torch.softmax(torch.randn(1, k, vocab, generator=gen) * 2, -1)
    ids = torch.stack([torch.multinomial(q[0, i], n, replacement=True, generator=gen) for i in range(k)], 1)
    out = rejection_sample(ids, q.expand(n, k, vocab), p.expand(n, k + 1, vocab), gen)
    second = out[:, 1][out[:, 1] >= 0]
    hist = torch.bincount(second, minlength=vocab).float() / len(second)
    assert 0.5 * (hist - p[0, 1]).abs().sum().item() < 0.02


def test_seeded_determinism():
    vocab, k = 10, 4
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(8, k + 1, vocab, generator=gen), -1)
    q = torch.softmax(torch.randn(8, k, vocab, generator=gen), -1)
    ids = torch.randint(0, vocab, (8, k), generator=gen)
    a = rejection_sample(ids, q, p, torch.Generator().manual_seed(42))
    b = rejection_sample(ids, q, p, torch.Generator().manual_seed(42))
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "ids, q, p, message",
    [
        (torch.zeros(2, dtype=torch.long), torch.zeros(2, 1, 4), torch.zeros(2, 2, 4), "draft_token_ids must be"),
        (torch.zeros(1, 2, dtype=torch.long), torch.full((1, 2, 4), 0.25), torch.full((1, 2, 4), 0.25), "target_probs"),
        (torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1, 5), 0.2), torch.full((1, 2, 4), 0.25),
         "vocab mismatch"),
        (torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1, 4), 0.5), torch.full((1, 2, 4), 0.25), "sum to 1"),
        (torch.full((1, 1), 9, dtype=torch.long), torch.full((1, 1, 4), 0.25), torch.full((1, 2, 4), 0.25), "lie in"),
        (torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1, 4), -0.25), torch.full((1, 2, 4), 0.25),
         "non-negative"),
    ],
)
def test_bad_input_raises_clear_error(ids, q, p, message):
    with pytest.raises(ValueError, match=message):
        rejection_sample(ids, q, p)


def test_process_logits_greedy_is_one_hot_and_top_k_top_p_restrict_support():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    probs = process_logits(
        logits, torch.tensor([0.0, 1.0, 1.0]), top_p=torch.tensor([1.0, 1.0, 0.6]), top_k=torch.tensor([0, 2, 0])
    )
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs[1, 0] == 0 and probs[1, 3] == 0 and probs[1, 1] > probs[1, 2] > 0
    assert probs[2, 1] == 1.0  # the top token alone already holds >= 0.6 of the mass
    assert torch.allclose(probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("top_p", [7e-46, 1e-45, 1e-30, 1e-8])
def test_top_p_at_the_fp32_underflow_edge_keeps_the_most_likely_token(top_p):
    """A positive top_p (valid as a float64) that rounds to 0 or a denormal in fp32 still keeps the
    most likely token: the row is that token's one-hot, never all-zero (which sampled one token id
    repeated, whatever the logits)."""
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    probs = process_logits(logits, torch.tensor([1.0, 0.7]), top_p=torch.tensor([top_p, top_p], dtype=torch.float64),
                           top_k=torch.tensor([0, 0]))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]

"""Logits processing and the speculative rejection sampler.

Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative Decoding"
(arXiv 2211.17192), Algorithm 1. Vocabulary used throughout the project:

- p = the *target* distribution (the model whose output we must reproduce),
  q = the *draft* distribution (the cheap proposer). The paper calls them M_p and M_q.
- A draft token x at position i is **accepted** with probability min(1, p(x) / q(x)).
- At the first rejection we emit one **recovered** token sampled from norm(max(0, p - q)) and stop.
- If all K draft tokens are accepted we emit one **bonus** token sampled from p at position K.

So every verify pass emits between 1 and K+1 tokens, and the emitted sequence follows p exactly.
Temperature 0 is the one-hot limit of the same algorithm: accept iff the draft token is the
target's argmax, the recovered token is the target's argmax.

Randomness comes in as a ``torch.Generator`` so callers control determinism.
"""

from __future__ import annotations

import torch

_DIST_ATOL = 1e-3


def process_logits(
    logits: torch.Tensor,  # [B, ..., V]
    temperature: torch.Tensor,  # [B]; 0 means greedy
    top_p: torch.Tensor | None = None,  # [B] in (0, 1]
    top_k: torch.Tensor | None = None,  # [B]; 0 means no limit
) -> torch.Tensor:  # [B, ..., V] probabilities (float32)
    """Turn logits into the distribution a request samples from.

    Applied identically to draft and target logits, so speculation reproduces the *processed*
    target distribution. Greedy rows become one-hot on the argmax (ties: lowest index).
    """
    logits = logits.float()
    extra_dims = logits.dim() - 2
    shape = (-1,) + (1,) * (extra_dims + 1)
    temps = temperature.to(logits.device, torch.float32).view(shape)
    greedy = temps == 0
    one_hot = None
    if bool(greedy.any()):
        one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        if bool(greedy.all()):
            return one_hot
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)
    if top_k is not None:
        scaled = _apply_top_k(scaled, top_k.to(logits.device).view(shape))
    if top_p is not None:
        scaled = _apply_top_p(scaled, top_p.to(logits.device, torch.float32).view(shape))
    probs = torch.softmax(scaled, dim=-1)
    return probs if one_hot is None else torch.where(greedy, one_hot, probs)


def process_logits_per_row(logits: torch.Tensor, rows) -> torch.Tensor:  # [B, ..., V] -> probabilities
    """``process_logits`` with each row's settings taken from ``rows`` (objects with
    ``temperature``, ``top_p`` and ``top_k``: proposal requests, verify items)."""
    return process_logits(
        logits,
        torch.tensor([r.temperature for r in rows]),
        torch.tensor([r.top_p for r in rows]),
        torch.tensor([r.top_k for r in rows]),
    )


def _apply_top_k(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = scaled.shape[-1]
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    if bool((k >= vocab).all()):
        return scaled
    kth = scaled.sort(dim=-1, descending=True).values.gather(-1, (k - 1).expand(*scaled.shape[:-1], 1))
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _apply_top_p(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    if bool((top_p >= 1).all()):
        return scaled
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    # The most likely token always stays (as HF's and vLLM's filters keep it): a top_p that rounds
    # to 0 in this dtype (a valid float64 below ~7e-46) would otherwise drop every token.
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))


def sample_categorical(
    probs: torch.Tensor,  # [B, V]
    generator: torch.Generator | None = None,
) -> torch.LongTensor:  # [B]
    """Inverse-CDF sampling: one uniform per row, exact for one-hot rows (zero-mass tokens never drawn)."""
    cdf = probs.float().cumsum(-1)  # [B, V]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor,  # [B, K, V] q: the distributions the draft sampled from
    target_probs: torch.Tensor,  # [B, K+1, V] p: target at the K draft positions + the bonus position
    generator: torch.Generator | None = None,
) -> torch.LongTensor:  # [B, K+1]
    """Leviathan et al. 2023, Algorithm 1, batched.

    Returns per row the accepted draft tokens, then one recovered token (first rejection) or the
    bonus token (all K accepted); the rest of the row is -1.
    """
    _validate(draft_token_ids, draft_probs, target_probs)
    return rejection_sample_unchecked(draft_token_ids, draft_probs, target_probs, generator)


def rejection_sample_unchecked(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K+1, V]
    generator: torch.Generator | None = None,
) -> torch.LongTensor:  # [B, K+1]
    """``rejection_sample`` without input validation, for the engine's hot path (its inputs come
    from ``process_logits`` and the proposers, so they are distributions by construction)."""
    batch, k = draft_token_ids.shape
    device = target_probs.device
    draft_token_ids = draft_token_ids.to(device)
    draft_probs = draft_probs.to(device, torch.float32)
    target_probs = target_probs.float()

    q_tok = draft_probs.gather(-1, draft_token_ids.unsqueeze(-1)).squeeze(-1)  # [B, K]
    p_tok = target_probs[:, :k].gather(-1, draft_token_ids.unsqueeze(-1)).squeeze(-1)  # [B, K]
    u = torch.rand(batch, k, generator=generator, device=device)
    # Strict inequality: u in [0, 1), so p == q accepts surely and p == 0 never accepts.
    accepted = (u * q_tok < p_tok).long()
    num_accepted = accepted.cumprod(-1).sum(-1)  # [B]

    rows = torch.arange(batch, device=device)
    p_at = target_probs[rows, num_accepted]  # [B, V]: target at the first rejection, or the bonus position
    q_at = torch.zeros_like(p_at)
    rejected = num_accepted < k
    if k > 0:
        q_at[rejected] = draft_probs[rows[rejected], num_accepted[rejected]]
    residual = (p_at - q_at).clamp_(min=0)
    mass = residual.sum(-1, keepdim=True)
    # p == q leaves no residual mass; rejection then has probability 0, fall back to p for safety.
    final_dist = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_at)
    final_token = sample_categorical(final_dist, generator)  # [B]

    out = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    positions = torch.arange(k + 1, device=device).unsqueeze(0)  # [1, K+1]
    if k > 0:
        keep = positions[:, :k] < num_accepted.unsqueeze(-1)
        out[:, :k] = torch.where(keep, draft_token_ids, out[:, :k])
    out[rows, num_accepted] = final_token
    return out


def greedy_verify(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    target_logits: torch.Tensor,  # [B, K+1, V] target logits at the K draft positions + the bonus position
) -> list[list[int]]:
    """Temperature 0: the one-hot limit of ``rejection_sample``, straight from the logits.

    With p = one-hot(argmax target) and q = one-hot(draft token), a draft token is accepted iff it
    is the target's argmax, and the recovered (or bonus) token is the argmax at the first mismatch.
    Skips building [B, K+1, V] distributions: at batch 1 that saved ~0.4 ms of a ~5 ms verify step.
    """
    k = draft_token_ids.shape[1]
    best = target_logits.argmax(-1)  # [B, K+1]
    matches = (draft_token_ids.to(best.device) == best[:, :k]).long()
    num_accepted = matches.cumprod(-1).sum(-1).tolist()  # [B]
    best_rows = best.tolist()
    return [row[: n + 1] for row, n in zip(best_rows, num_accepted)]


def _validate(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor) -> None:
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [batch, k], got shape {tuple(draft_token_ids.shape)}")
    if draft_token_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_token_ids must be an integer tensor, got {draft_token_ids.dtype}")
    batch, k = draft_token_ids.shape
    if draft_probs.dim() != 3 or tuple(draft_probs.shape[:2]) != (batch, k):
        raise ValueError(f"draft_probs must be [batch={batch}, k={k}, vocab], got {tuple(draft_probs.shape)}")
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (batch, k + 1):
        raise ValueError(
            f"target_probs must be [batch={batch}, k+1={k + 1}, vocab], got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[-1]
    if draft_probs.shape[-1] != vocab:
        raise ValueError(f"vocab mismatch: draft_probs has {draft_probs.shape[-1]}, target_probs has {vocab}")
    if k > 0 and (bool((draft_token_ids < 0).any()) or bool((draft_token_ids >= vocab).any())):
        raise ValueError(f"draft_token_ids must lie in [0, {vocab})")
    for name, probs in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if probs.numel() == 0:
            continue
        if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
            raise ValueError(f"{name} must be finite and non-negative")
        sums = probs.float().sum(-1)
        if not bool(torch.allclose(sums, torch.ones_like(sums), atol=_DIST_ATOL)):
            raise ValueError(f"{name} rows must sum to 1 (got sums in [{sums.min():.4f}, {sums.max():.4f}])")

"""Exact target distributions for the statistical tests: the marginals that sampled output must
follow (Leviathan et al. 2023: speculative sampling leaves the target distribution p unchanged),
and the total-variation distance a histogram of n samples shows from its own distribution."""

from __future__ import annotations

import torch


def exact_marginals(model_path: str, prompt: list[int], depth: int, temperature: float, top_k: int, top_p: float
                    ) -> list[torch.Tensor]:
    """The processed target distribution of output tokens 1..depth, marginalised exactly over the
    tokens before them (HF forwards over the whole support tree; small for top-k sampling)."""
    from transformers import AutoModelForCausalLM

    from specdec_core.sampling import process_logits

    model = AutoModelForCausalLM.from_pretrained(model_path)
    knobs = (torch.tensor([temperature]), torch.tensor([top_p]), torch.tensor([top_k]))

    @torch.no_grad()
    def dist(ids):
        return process_logits(model(torch.tensor([ids])).logits[0, -1:], *knobs)[0]

    marginals, paths = [], [(prompt, 1.0)]
    for _ in range(depth):
        level = torch.zeros(model.config.vocab_size)
        next_paths = []
        for ids, weight in paths:
            p = dist(ids)
            level += weight * p
            next_paths += [(ids + [t], weight * p[t].item()) for t in p.nonzero().flatten().tolist()]
        marginals.append(level)
        paths = next_paths
    return marginals


def expected_tv(p: torch.Tensor, n: int) -> float:
    """Mean total-variation distance of an n-sample histogram from its own distribution p
    (normal approximation of each bin's |error|)."""
    return 0.5 * torch.sqrt(2 * p * (1 - p) / (torch.pi * n)).sum().item()

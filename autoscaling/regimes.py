"""The regime vocabulary: why speculation does or does not pay for a request, and the thresholds routing
reads.

Leviathan et al. 2023 (arXiv 2211.17192): a draft model (q) proposes K tokens, the target (p) verifies them in
one forward; a proposed token is accepted with probability min(1, p/q), the first rejected one is replaced by a
recovered token from the residual max(0, p - q), and a bonus token is sampled from p when all K are accepted.
With acceptance rate a and cost ratio c (a draft step over a target step), Corollary 3.9: a speedup needs
a > c. The labels below are docs/ARCHITECTURE.md's (Facts); every routing decision carries one, and
``/v1/regimes`` counts them per traffic class.
"""

from __future__ import annotations

from dataclasses import dataclass

REGIMES = (
    "favorable",
    "high_entropy",
    "expensive_draft",
    "domain_mismatch",
    "large_batch",
    "orchestration_overhead",
    "long_context",
    "prefill_heavy",
    "no_gain",
    "unknown",
)


@dataclass(frozen=True)
class RoutingThresholds:
    margin: float = 0.05  # speculate only above 1 + margin predicted speedup
    split_margin: float = 0.10  # on shared cores, leave the pool that holds the load only for this much more
    declined_share: float = 0.5  # a pool whose adaptive K ran this share of such requests' steps plain is not sent them
    high_temperature: float = 0.7
    low_acceptance: float = 0.5
    min_evidence: float = 50.0  # judged tokens before a low a is blamed on the traffic
    expensive_cost_ratio: float = 0.5
    min_decode_tokens: int = 16
    prefill_ratio: float = 8.0  # prompt_tokens > prefill_ratio * max_tokens: prefill heavy


@dataclass(frozen=True)
class RegimeEvidence:
    """What `classify_regime` looks at; speedups are the best K's, at the batch the request joins."""

    temperature: float
    prompt_tokens: int
    max_tokens: int
    context_limit: int
    acceptance: float
    evidence: float
    cost_ratio: float
    speedup: float
    speedup_batch1: float  # same pool, batch 1
    speedup_no_hop: float  # same pool and batch, hop overhead removed
    speedup_short_context: float  # same pool and batch, at a short context


def classify_regime(ev: RegimeEvidence, th: RoutingThresholds) -> str:
    """Why speculation does or does not pay; first matching row wins.

    | regime                 | condition                                                   |
    |------------------------|-------------------------------------------------------------|
    | prefill_heavy          | max_tokens < min_decode_tokens or prompt > ratio*max_tokens |
    | long_context           | it pays at this context and not at a short one, or the      |
    |                        | other way round: the context decided                        |
    | favorable              | speedup > 1 + margin                                        |
    | orchestration_overhead | would pay without the topology's hops                       |
    | large_batch            | would pay at batch 1, not at this batch                     |
    | high_entropy           | a < low_acceptance, temperature > high_temperature          |
    | domain_mismatch        | a < low_acceptance at low temperature: draft disagrees      |
    | expensive_draft        | c >= a (Corollary 3.9) or c >= expensive_cost_ratio         |
    | no_gain                | none of the above: the numbers (a, c, speedup) say no       |

    ("unknown" is only the label of a request no speculative pool could price.)

    The two low-acceptance rows need `min_evidence` judged tokens, so a prior is
    never reported as a property of the traffic.
    """
    pays = 1.0 + th.margin
    low_a = ev.acceptance < th.low_acceptance and ev.evidence >= th.min_evidence
    if ev.max_tokens < th.min_decode_tokens or ev.prompt_tokens > th.prefill_ratio * ev.max_tokens:
        return "prefill_heavy"
    if (ev.speedup > pays) != (ev.speedup_short_context > pays):
        return "long_context"
    if ev.speedup > pays:
        return "favorable"
    if ev.speedup_no_hop > pays:
        return "orchestration_overhead"
    if ev.speedup_batch1 > pays:
        return "large_batch"
    if low_a:
        return "high_entropy" if ev.temperature > th.high_temperature else "domain_mismatch"
    if ev.cost_ratio >= ev.acceptance or ev.cost_ratio >= th.expensive_cost_ratio:
        return "expensive_draft"
    return "no_gain"

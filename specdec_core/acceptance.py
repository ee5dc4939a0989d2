"""Online acceptance statistics per traffic class.

The cost model (Leviathan et al. 2023, arXiv 2211.17192, Theorem 3.8) needs the
per-token acceptance rate a of a draft against the target; a depends on the
traffic (temperature, domain), so it is estimated per `TrafficClass`.

Estimator. One speculative step proposes K tokens and accepts n of them; the
first rejection ends the step, so positions after it are never judged. Under
the model's assumption that each judged token is accepted with probability a,
the step's likelihood is a^n (1 - a) if n < K (n accepts, then one rejection)
and a^K if n = K. Summing over steps, the maximum-likelihood estimate is

    a_hat = sum(accepted) / sum(judged),  judged = n + 1 if n < K else K.

The naive sum(accepted) / sum(proposed) is biased low: it counts the unjudged
positions after a rejection as rejections (a = 0.8, K = 8 gives ~0.42 instead
of 0.8). If the sampler judges every position (some do, even after a
rejection), pass its decisions as `per_position` and all of them are counted.

Prior and decay. a_hat is the mean of a Beta posterior with a prior of
`prior_weight` pseudo-tokens at `prior_mean` (per draft, e.g. from the model
card), so a new class starts at the prior and moves as evidence arrives.
Observed counts decay by half every `half_life_tokens` judged tokens of the
class, so a traffic shift is noticed within a few half-lives; `evidence` is the
decayed judged count. Per-position counts (same decay) show whether acceptance
falls with depth, which caps useful K.

Proposal coverage. Acceptance is counted over positions that were proposed and judged. A
lookup proposer (n-gram) may return fewer tokens than asked, or none; `ProposalCoverage`
counts, per request and position, how often an ask came back, which the budgeted planner
multiplies into a position's expected yield (a draft model always delivers: 1).

Not thread-safe: one owner (the router or an engine loop) updates it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TEMPERATURE_BUCKETS = ("greedy", "low", "mid", "high")  # 0, (0, 0.5], (0.5, 1.0], > 1.0


def temperature_bucket(temperature: float) -> str:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return "greedy"
    if temperature <= 0.5:
        return "low"
    return "mid" if temperature <= 1.0 else "high"


@dataclass(frozen=True)
class TrafficClass:
    draft: str
    temperature_bucket: str
    domain: str = "default"

    @classmethod
    def of(cls, draft: str, temperature: float, domain: str = "default") -> TrafficClass:
        return cls(draft, temperature_bucket(temperature), domain)

    def key(self) -> str:
        return f"{self.draft}/{self.temperature_bucket}/{self.domain}"


@dataclass
class _ClassStats:
    accepted: float = 0.0  # decayed accepted tokens
    judged: float = 0.0  # decayed judged positions
    steps: int = 0  # raw count, for display
    pos_accepted: list[float] = field(default_factory=list)
    pos_judged: list[float] = field(default_factory=list)
    aged_at: float = 0.0  # clock time up to which the time decay has been applied

    def decay(self, factor: float) -> None:
        self.accepted *= factor
        self.judged *= factor
        self.pos_accepted = [x * factor for x in self.pos_accepted]
        self.pos_judged = [x * factor for x in self.pos_judged]

    def add(self, decisions: Sequence[bool]) -> None:
        grow = len(decisions) - len(self.pos_judged)
        if grow > 0:
            self.pos_accepted += [0.0] * grow
            self.pos_judged += [0.0] * grow
        for i, ok in enumerate(decisions):
            self.pos_judged[i] += 1.0
            self.pos_accepted[i] += float(ok)
        self.accepted += sum(decisions)
        self.judged += len(decisions)
        self.steps += 1


def judged_positions(proposed: int, accepted: int) -> list[bool]:
    """Decisions a first-rejection-ends-the-step sampler made: n accepts, then a rejection if n < K."""
    if not 0 <= accepted <= proposed:
        raise ValueError(f"need 0 <= accepted <= proposed, got {accepted}, {proposed}")
    return [True] * accepted + ([False] if accepted < proposed else [])


class AcceptanceTracker:
    def __init__(
        self,
        prior_mean: float = 0.6,
        prior_weight: float = 20.0,
        half_life_tokens: float = 2000.0,
        draft_prior_means: Mapping[str, float] | None = None,
        half_life_s: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not 0.0 < prior_mean < 1.0 or prior_weight <= 0 or half_life_tokens <= 0:
            raise ValueError("need 0 < prior_mean < 1, prior_weight > 0, half_life_tokens > 0")
        if (half_life_s is None) != (clock is None) or (half_life_s is not None and half_life_s <= 0):
            raise ValueError("time decay needs both half_life_s > 0 and a clock")
        self.half_life_s = half_life_s
        self._clock = clock
        self.prior_mean = prior_mean
        self.prior_weight = prior_weight
        self.half_life_tokens = half_life_tokens
        self.draft_prior_means = dict(draft_prior_means or {})
        self._stats: dict[TrafficClass, _ClassStats] = {}

    def observe(
        self, cls: TrafficClass, proposed: int, accepted: int, per_position: Sequence[bool] | None = None
    ) -> None:
        """Record one step of one request. K = 0 steps judge nothing and are ignored."""
        decisions = judged_positions(proposed, accepted) if per_position is None else list(per_position)
        if per_position is not None and not _consistent(decisions, proposed, accepted):
            raise ValueError(f"per_position {decisions} disagrees with proposed={proposed}, accepted={accepted}")
        if not decisions:
            return
        stats = self._entry(cls)
        stats.decay(0.5 ** (len(decisions) / self.half_life_tokens))
        stats.add(decisions)

    def observe_request(
        self, cls: TrafficClass, judged_per_position: Sequence[int], accepted_per_position: Sequence[int],
        steps: int = 1,
    ) -> None:
        """Record a finished request's aggregate counts at once (e.g. ``RequestStats``:
        ``proposed_per_position`` counts judged positions there). Same decay as ``steps`` calls of
        `observe` with the same totals, except that the request's own tokens are not decayed against each
        other (negligible for requests much shorter than a half-life); ``steps`` is its verify steps."""
        judged, accepted = list(judged_per_position), list(accepted_per_position)
        if len(judged) != len(accepted) or any(not 0 <= a <= j for a, j in zip(accepted, judged)):
            raise ValueError(f"need 0 <= accepted <= judged per position, got {accepted}, {judged}")
        total = sum(judged)
        if total == 0:
            return
        stats = self._entry(cls)
        stats.decay(0.5 ** (total / self.half_life_tokens))
        grow = len(judged) - len(stats.pos_judged)
        if grow > 0:
            stats.pos_accepted += [0.0] * grow
            stats.pos_judged += [0.0] * grow
        for i, (a, j) in enumerate(zip(accepted, judged)):
            stats.pos_judged[i] += j
            stats.pos_accepted[i] += a
        stats.accepted += sum(accepted)
        stats.judged += total
        stats.steps += max(int(steps), 1)

    def _get(self, cls: TrafficClass) -> _ClassStats | None:
        """A class's counts, with the time decay applied up to now."""
        stats = self._stats.get(cls)
        if stats is not None and self._clock is not None:
            now = self._clock()
            stats.decay(0.5 ** (max(0.0, now - stats.aged_at) / self.half_life_s))
            stats.aged_at = now
        return stats

    def _entry(self, cls: TrafficClass) -> _ClassStats:
        stats = self._get(cls)
        if stats is None:
            stats = self._stats[cls] = _ClassStats(aged_at=self._clock() if self._clock else 0.0)
        return stats

    def forget_domain(self, domain: str) -> None:
        """Drop every class of ``domain`` (its traffic counts under another class from now on)."""
        for cls in [c for c in self._stats if c.domain == domain]:
            del self._stats[cls]

    def prior(self, cls: TrafficClass) -> float:
        return self.draft_prior_means.get(cls.draft, self.prior_mean)

    def shrink(self, accepted: float, judged: float, prior: float) -> float:
        """One request's evidence (accepted of judged draft tokens) shrunk towards ``prior`` (its
        class's estimate), which counts as ``prior_weight`` judged tokens."""
        return (accepted + self.prior_weight * prior) / (judged + self.prior_weight)

    def estimate(self, cls: TrafficClass) -> float:
        """Posterior mean of a: (prior pseudo-accepts + accepted) / (prior weight + judged)."""
        stats = self._get(cls)
        accepted, judged = (stats.accepted, stats.judged) if stats else (0.0, 0.0)
        return (self.prior(cls) * self.prior_weight + accepted) / (self.prior_weight + judged)

    def evidence(self, cls: TrafficClass) -> float:
        """Effective number of judged tokens behind the estimate (decayed; prior excluded)."""
        stats = self._get(cls)
        return stats.judged if stats else 0.0

    def position_rates(self, cls: TrafficClass) -> list[float]:
        """Acceptance rate at each draft position, shrunk to the class estimate like `estimate`."""
        stats = self._get(cls)
        if stats is None:
            return []
        a = self.estimate(cls)
        w = self.prior_weight
        return [(a * w + acc) / (w + n) for acc, n in zip(stats.pos_accepted, stats.pos_judged)]

    def rates_by_position(self, cls: TrafficClass, k: int) -> list[float]:
        """[k] the class's acceptance rate at each draft position (``position_rates``), its estimate
        where no step has judged that deep."""
        rates = self.position_rates(cls)[:k]
        return rates + [self.estimate(cls)] * (k - len(rates))

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view for the /v1/regimes endpoint."""
        return {
            "prior_mean": self.prior_mean,
            "prior_weight": self.prior_weight,
            "half_life_tokens": self.half_life_tokens,
            "draft_prior_means": dict(self.draft_prior_means),
            "classes": [
                {
                    "draft": cls.draft,
                    "temperature_bucket": cls.temperature_bucket,
                    "domain": cls.domain,
                    "acceptance": self.estimate(cls),
                    "evidence": stats.judged,
                    "steps": stats.steps,
                    "per_position": self.position_rates(cls),
                }
                for cls, stats in sorted(((c, self._get(c)) for c in list(self._stats)),
                                         key=lambda kv: kv[0].key())
            ],
        }


def position_rates(accepted_per_position: Sequence[int], judged_per_position: Sequence[int],
                   prior_rates: Sequence[float], prior_weight: float) -> list[float]:
    """[len(prior_rates)] one request's acceptance rate at each draft position (accepted of judged
    there: the rate conditional on the positions before it surviving), each shrunk towards its
    class's rate at that position (``prior_rates``) as ``prior_weight`` judged tokens."""
    own = list(zip(accepted_per_position, judged_per_position))
    own += [(0, 0)] * (len(prior_rates) - len(own))
    return [(acc + prior_weight * prior) / (judged + prior_weight) for (acc, judged), prior in zip(own, prior_rates)]


@dataclass
class ProposalCoverage:
    """How much of what a request asked of its proposer came back. A draft model proposes every
    token asked; a lookup (the n-gram proposer) proposes only what followed its match, or nothing. A
    position that was asked but not proposed yields no token, however likely acceptance is where
    tokens are proposed (``position_rates`` is conditional on the position being judged), so a plan
    that counts on it expects tokens that never come."""

    asked: list[int] = field(default_factory=list)  # [K] steps that asked for >= i + 1 tokens
    offered: list[int] = field(default_factory=list)  # [K] of those, steps whose proposal had >= i + 1

    def record(self, asked: int, offered: int) -> None:
        """One proposal: ``asked`` tokens asked, ``offered`` proposed (<= asked)."""
        while len(self.asked) < asked:
            self.asked.append(0)
            self.offered.append(0)
        for pos in range(asked):
            self.asked[pos] += 1
            self.offered[pos] += pos < offered

    def rates(self, k: int, prior_weight: float = 1.0) -> list[float]:
        """[k] P(position i + 1 is proposed when asked), shrunk towards 1 (a proposer delivers what
        it is asked until seen otherwise) as ``prior_weight`` asks; non-increasing (the share of
        asks a proposal reaches cannot grow with depth)."""
        out, cap = [], 1.0
        for pos in range(k):
            asked, offered = (self.asked[pos], self.offered[pos]) if pos < len(self.asked) else (0, 0)
            if asked + prior_weight:  # never asked this deep (and no prior): no better than above
                cap = min(cap, (offered + prior_weight) / (asked + prior_weight))
            out.append(cap)
        return out


def _consistent(decisions: Sequence[bool], proposed: int, accepted: int) -> bool:
    """The first `accepted` decisions are accepts and the next (if any) a rejection."""
    if not accepted + (accepted < proposed) <= len(decisions) <= proposed:
        return False
    return all(decisions[:accepted]) and (accepted == proposed or not decisions[accepted])

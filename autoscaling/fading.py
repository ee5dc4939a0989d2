"""Fading means (and shares of outcomes): a moving average per key that fades toward 0 with a
half-life since it was last updated, so that what the router learnt of a burst or a load does not outlive it;
and moving means that do not fade, for lessons whose 0 would read as a measurement (``MovingMeans``).
Pure: the clock comes in as an argument, as in the other policies of this package."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator

SHARE_FLOOR = 1e-3  # shares below this are dropped: outcomes long faded, not worth pricing


class FadingMeans:
    def __init__(self, weight: float, half_life_s: float, clock: Callable[[], float]):
        self.weight, self.half_life_s, self.clock = weight, half_life_s, clock
        self._values: dict[Hashable, tuple[float, float]] = {}  # key -> (mean when updated, when)

    def get(self, key: Hashable) -> float:
        value, at = self._values.get(key, (0.0, 0.0))
        return value * 0.5 ** ((self.clock() - at) / self.half_life_s)

    def age(self, key: Hashable) -> float:
        """Seconds since the key was last updated (inf: never)."""
        return self.clock() - self._values[key][1] if key in self._values else float("inf")

    def update(self, key: Hashable, observed: float, share: float = 1.0) -> None:
        """Move the key's mean toward ``observed`` by the weight, times ``share`` for an observation
        worth that share of a whole one."""
        value = self.get(key)
        self._values[key] = (value + self.weight * share * (observed - value), self.clock())

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._values)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._values


class FadingShares:
    """A fading distribution per key over integer outcomes: each outcome's share is a fading mean of
    whether it was observed (``FadingMeans`` of an indicator), so a key's shares fade toward the outcome
    0 once nothing is learnt, as ``FadingMeans`` fades toward 0, and its mean is the ``FadingMeans``
    mean of the same observations. A fractional observation splits between the two integers around it
    in proportion, which keeps that mean exact."""

    def __init__(self, weight: float, half_life_s: float, clock: Callable[[], float]):
        self._means = FadingMeans(weight, half_life_s, clock)
        self._outcomes: dict[Hashable, set[int]] = {}

    def update(self, key: Hashable, observed: float) -> None:
        low = math.floor(observed)
        hit = {low: 1.0 - (observed - low), low + 1: observed - low}
        outcomes = self._outcomes.setdefault(key, set())
        outcomes |= {o for o, share in hit.items() if share}
        for o in outcomes:
            self._means.update((key, o), hit.get(o, 0.0))

    def shares(self, key: Hashable) -> dict[int, float]:
        """Outcome -> share, summing to 1 (the faded share is the outcome 0's, as are shares under ``SHARE_FLOOR``)."""
        shares = {o: share for o in self._outcomes.get(key, ()) if (share := self._means.get((key, o))) > SHARE_FLOOR}
        shares[0] = shares.get(0, 0.0) + 1.0 - sum(shares.values())  # faded, and dropped as faded
        return shares

    def mean(self, key: Hashable) -> float:
        return sum(o * s for o, s in self.shares(key).items())


class MovingMeans:
    """A moving average per key that does not fade: the mean of its first observations until ``1 / n`` falls
    under the weight, then an exponential moving average. For lessons that hold until observations change
    them, where a faded one would read as a measured 0 (a time to first token)."""

    def __init__(self, weight: float):
        self.weight = weight
        self._values: dict[Hashable, tuple[float, int]] = {}  # key -> (mean, observations)

    def update(self, key: Hashable, observed: float) -> None:
        value, n = self._values.get(key, (0.0, 0))
        self._values[key] = (value + max(self.weight, 1.0 / (n + 1)) * (observed - value), n + 1)

    def get(self, key: Hashable) -> float:
        return self._values.get(key, (0.0, 0))[0]

    def count(self, key: Hashable) -> int:
        return self._values.get(key, (0.0, 0))[1]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._values)

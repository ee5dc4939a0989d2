"""Fading means: a moving average per key that fades toward 0 with a half-life since it was last
updated, so that what the router learnt of a burst or a load does not outlive it. Pure: the clock
comes in as an argument, as in the other policies of this package."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator


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

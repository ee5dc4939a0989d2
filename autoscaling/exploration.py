"""Exploration: a traffic class that auto routing sends to plain decoding for its acceptance
still sends a few probe requests to speculation, so its estimate keeps meeting evidence.

Without it a class locks out: routed plain, it judges no draft tokens, so the estimate that sent
it there never changes (measured: one collapsed request sent every later auto request of the
class to the plain pool for good, while explicit speculation was 1.14x faster). A probe is one
request of the class run speculatively with a fixed K, every draft token judged; at most
``share`` of the class's plain-routed requests are probes, and no two within ``min_interval_s``.
Which requests may probe, and at what K, is the routing policy's (``probes.probe_route``: only
where speculation would pay were acceptance high). The same schedule, keyed by pool and batch
bucket, runs the router's cost probes (``probes.scheduled_probe``). A pure policy: the clock comes in as ``now``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass
class _Schedule:
    plain_since_probe: int = 0  # the class's plain-routed requests since its last probe
    last_probe_at: float = -math.inf


class Exploration:
    def __init__(self, share: float = 0.05, min_interval_s: float = 1.0):
        if not 0.0 <= share <= 1.0 or min_interval_s < 0:
            raise ValueError("need 0 <= share <= 1 and min_interval_s >= 0")
        self.share = share
        self.min_interval_s = min_interval_s
        self._schedules: dict[Hashable, _Schedule] = {}

    def probe_due(self, key: Hashable, now: float) -> bool:
        """One more request of ``key`` (a traffic class) could probe: is it the one? (True starts the
        next period: the caller runs it as a probe.)"""
        s = self._schedules.setdefault(key, _Schedule())
        s.plain_since_probe += 1
        if self.share <= 0 or s.plain_since_probe * self.share < 1 or now - s.last_probe_at < self.min_interval_s:
            return False
        s.plain_since_probe, s.last_probe_at = 0, now
        return True

    def forget_domain(self, domain: str) -> None:
        for cls in [c for c in self._schedules if getattr(c, "domain", None) == domain]:
            del self._schedules[cls]

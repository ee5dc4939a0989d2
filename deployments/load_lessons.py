"""What the router learns about its pools' load from the requests they serve (no Ray here).

Routing (``autoscaling/routing.py``) prices a request at the batch it will decode in and over its whole
latency; three lessons from served requests correct what the pools' counters alone say, each keyed by pool and
batch bucket (``StepDrift.bucket``: powers of two), and read into ``PoolLoad`` by ``RouteState``:

- **joining**: the rows that joined a request while it decoded (a burst's first request joins an idle pool and
  decodes beside the rest of the burst), as shares over outcomes; faded, so that a burst's pricing does not
  outlive the burst;
- **declined**: the share of an auto request's decode steps that its pool's adaptive K ran plain (the engine's
  verdict, from its measured steps, on the speculation routed there), per traffic class; faded;
- **waits**: a finished request's TTFT and the other requests' prefills it waited for per second of its own
  steps (``RequestWaits``); not faded.

Where the pools share their cores, joining and declined are the whole load's (one lesson for every pool).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from autoscaling.fading import FadingMeans, FadingShares, MovingMeans
from autoscaling.routing import PLAIN_POOL, SPEC_TOPOLOGIES, Pool, RequestWaits
from deployments.messages import Progress
from specdec_core.acceptance import TrafficClass
from specdec_core.drift import StepDrift
from specdec_core.stats import RequestStats

# Rows that join a request while it decodes (mean decode batch - joined batch; negative where rows leave), per
# pool and joined-batch bucket: a moving average over finished requests that fades with this half-life, so
# that a burst's pricing does not outlive the burst.
JOINING_WEIGHT = 0.2
JOINING_HALF_LIFE_S = 30.0
# What the pools' adaptive K declined (``LoadLessons.declined``): a moving share of decode steps, learnt from each
# window of this many decode steps of a request as it decodes (a shorter one, a request's last, counts for its
# share of a window), faded with this half-life so that a batch whose speculation the engine declined is offered
# it again once the lesson is old
DECLINED_WEIGHT = 0.2
DECLINE_WINDOW_STEPS = 16
DECLINED_HALF_LIFE_S = 60.0
# What a pool's requests waited for besides their own steps (``LoadLessons.waits``), per pool and batch bucket:
# moving means over finished requests that do not fade (a faded TTFT would read as a short one), believed
# from this many requests on
WAITS_WEIGHT = 0.1
WAITS_MIN_REQUESTS = 3


class LoadLessons:
    """The router's lessons from served requests: rows joining, steps declined, waits beside its own steps."""

    def __init__(self, shared_compute: bool = False, clock: Callable[[], float] = time.monotonic):
        self.shared_compute = shared_compute
        self._joining = FadingShares(JOINING_WEIGHT, JOINING_HALF_LIFE_S, clock)  # (pool, joined bucket) -> rows
        self._declined = FadingMeans(DECLINED_WEIGHT, DECLINED_HALF_LIFE_S, clock)  # (pool, bucket, class) -> share
        self._waits = MovingMeans(WAITS_WEIGHT)  # (pool, bucket, "ttft_s" | "prefill_wait_ratio") -> mean

    def joining(self, pool: str, joined: int) -> float:
        """Rows that joined ``pool``'s recent requests that joined at a batch like ``joined`` while they
        decoded (negative: rows left), faded since it was learnt. On shared cores the rows are the whole
        load's, and so is the lesson: one for every pool, so that no pool looks emptier than another
        for where its requests happened to join."""
        return self._joining.mean(self._joining_key(pool, joined))

    def joining_shares(self, pool: str, joined: int) -> tuple[tuple[int, float], ...]:
        """What ``joining`` averages: (rows that joined, share of the recent requests that saw as many).
        A request that opens a burst sees the burst's rows join it, one that ends a drain sees none, and
        the two join at the same batch; priced at their mean, the first request of a c=4 burst went where
        a lone request is fastest (the separate pool, at batch 2) and the burst split over two pools on the
        same cores (auto 0.92x co-located)."""
        return tuple(sorted(self._joining.shares(self._joining_key(pool, joined)).items()))

    def _joining_key(self, pool: str, joined: int) -> tuple[str, int]:
        return ("whole" if self.shared_compute else pool), StepDrift.bucket(joined)

    def learn_joining(self, pool: str, joined: int, decoded: float) -> None:
        self._joining.update(self._joining_key(pool, joined), decoded - joined)

    def declined(self, pool: str, batch: float, cls: TrafficClass | None) -> float:
        """Share of their decode steps that ``pool``'s adaptive K ran plain for the recent auto requests of
        ``cls`` that decoded at a batch like ``batch`` (the whole load's, on shared cores), faded since.

        On shared cores both speculative pools run their drafts and verifies on the same cores, so what
        one measured losing, the other's steps would lose too. A pool without a lesson of its own there
        takes the other's; and the co-located pool's verdict binds the separate pool even where that has
        its own: its rounds are the same forwards plus hops, and its overlap hides the draft behind the
        verify only on a core that is free, which a load of several rows does not leave. Without the
        first, the separate pool was the option left once co-located was declined and took 12-17% of
        auto's requests (tiny family, T=1, c=8-16) to learn its own lesson; without the second, it kept
        taking them on a lesson of 0.33 learnt beside the load (25% of auto's requests, T=0, c=8, where
        co-located had declined 57% of its steps and auto measured 0.86x plain)."""
        lessons = {p: self._declined.get(key) for p in SPEC_TOPOLOGIES
                   if (key := self._declined_key(p, StepDrift.bucket(batch), cls)) is not None}
        if not self.shared_compute or pool in lessons and pool != Pool.SEPARATE:
            return lessons.get(pool, 0.0)
        return max(lessons.values(), default=0.0)

    def _declined_key(self, pool: str, bucket: int, cls: TrafficClass | None) -> tuple | None:
        """The key of ``pool``'s lesson for ``cls`` at ``bucket``, or, where it has none there, at the nearest
        smaller batch bucket that has one (None: neither). Speculation pays less as the batch grows, so what
        adaptive K ran plain at a smaller batch it runs plain at this one. A closed loop at c=16 taught its
        lessons at the whole load's mean rows, 16 (bucket 4), and priced its requests at 17-19 (bucket 5:
        the rows that join a round's first requests): 100 of auto's 384 requests went co-located, where
        adaptive K ran 88% of their steps plain, and auto's p99 TPOT was 1.25x plain's (AMD host, greedy)."""
        return next((key for b in range(bucket, -1, -1) if (key := (pool, b, cls)) in self._declined), None)

    def learn_declined(self, pool: str, batch: float, cls: TrafficClass, window: Progress) -> None:
        """An auto request routed to speculation ran ``window``'s decode steps at a batch like ``batch`` (the
        whole load's, on shared cores): the share its pool's adaptive K ran plain, worth its share of
        ``DECLINE_WINDOW_STEPS``. The engine chose them from its measured step times (the regret guard:
        speculative steps against its own plain ones, on the cores as they are now), which the router's prices
        only model: on the tiny family at batch 8 the router priced K=2-3 at 1.07-1.15x plain, its requests ran
        63-91% of their steps plain there, and measured 0.84-0.95x of the plain pool. Learnt as requests
        decode, not once they finish: a burst's requests are routed while the first of them still decode, and
        at c=8 (T=0, 48 tokens) 16 of them followed the first into a pool that ran 82% of their steps plain."""
        if window.steps:
            self._declined.update((pool, StepDrift.bucket(batch), cls), window.plain_steps / window.steps,
                                  min(1.0, window.steps / DECLINE_WINDOW_STEPS))

    def waits(self, pool: str, bucket: int) -> RequestWaits | None:
        """What ``pool``'s finished requests that decoded at a batch in ``bucket`` (the whole load's, on shared
        cores) waited for besides their own steps (None: fewer than ``WAITS_MIN_REQUESTS`` measured it)."""
        if self._waits.count((pool, bucket, "ttft_s")) < WAITS_MIN_REQUESTS:
            return None
        return RequestWaits(self._waits.get((pool, bucket, "ttft_s")),
                            self._waits.get((pool, bucket, "prefill_wait_ratio")))

    def waits_beside_plain(self, pool: str, batch: float) -> tuple[RequestWaits, RequestWaits] | None:
        """(the plain pool's, ``pool``'s) ``waits`` at ``batch``'s bucket, or, where either is unmeasured there,
        at the nearest smaller bucket where both are (as ``declined`` does: the rows that join a round's first
        requests priced a c=16 load one bucket above the one its requests taught); None where none is. A
        speculative pool's side, unmeasured, is the other speculative pool's (``_speculative_waits``)."""
        for bucket in range(StepDrift.bucket(batch), -1, -1):
            plain, own = self.waits(PLAIN_POOL, bucket), self._speculative_waits(pool, bucket)
            if plain is not None and own is not None:
                return plain, own
        return None

    def _speculative_waits(self, pool: str, bucket: int) -> RequestWaits | None:
        """``pool``'s ``waits``; for a speculative pool that has none at ``bucket``, the other's there: the same
        prefills of the same target. Priced on its decode steps alone beside a pool priced with its waits, the
        unmeasured pool looked faster for want of a lesson: the separate topology took a c=16 round's first
        request at 1.9x where co-located's TTFT priced co-located lower, and the round followed it there (auto's
        p99 TPOT 1.44x plain's)."""
        own = self.waits(pool, bucket)
        if own is not None or pool not in SPEC_TOPOLOGIES:
            return own
        return next((w for other in SPEC_TOPOLOGIES if other != pool and (w := self.waits(other, bucket))), None)

    def waits_lessons(self) -> list[tuple[str, int, float, float, int]]:
        """The ``waits`` learnt: (pool, batch bucket, TTFT seconds, prefill waits per second of own steps,
        requests), for ``/v1/regimes``."""
        keys = sorted({key[:2] for key in self._waits})
        return [(pool, bucket, self._waits.get((pool, bucket, "ttft_s")),
                 self._waits.get((pool, bucket, "prefill_wait_ratio")), self._waits.count((pool, bucket, "ttft_s")))
                for pool, bucket in keys]

    def learn_waits(self, pool: str, batch: float, ttft_s: float, stats: RequestStats) -> None:
        key = (pool, StepDrift.bucket(batch))
        self._waits.update((*key, "ttft_s"), ttft_s)
        self._waits.update((*key, "prefill_wait_ratio"), stats.prefill_wait_s / stats.decode_s)

    def declined_lessons(self) -> list[tuple[str, int, TrafficClass | None, float, float]]:
        """What the pools' adaptive K declined, as routing reads it: (pool, batch bucket, class, share of
        steps run plain, seconds since a request last taught it); the lessons under 1% left out unless taught
        within a half-life (a pool that ran its requests' steps speculative is news too)."""
        lessons = []
        for key in self._declined:
            pool, bucket, cls = key
            share, age = self.declined(pool, 2 ** bucket, cls), self._declined.age(key)
            if share >= 0.01 or age < DECLINED_HALF_LIFE_S:
                lessons.append((pool, bucket, cls, share, age))
        return lessons

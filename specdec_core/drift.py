"""How far served or real steps run from the calibration: ``StepDrift``, learnt online per batch
bucket and per kind of step (plain, co-located speculative, the separate topology's rounds), and
applied by ``CostModel`` to the calibrated prices. Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MIN_SPEC_SHARE = 0.2  # of a mixed request's calibrated time: below it, what its speculative steps took is noise


@dataclass
class _Drift:
    plain: float = 1.0
    # The speculative kinds' factors are relative to plain's (``StepDrift``: measured / calibrated over
    # plain's factor when the step was measured): a step of the kind is priced at plain * its factor
    spec: float = 1.0  # co-located speculative steps
    separate: float = 1.0  # the separate topology's rounds (its hops and overlap as served)
    plain_steps: int = 0
    spec_steps: int = 0
    separate_steps: int = 0
    outlier_rate: float = 0.0  # moving share of observations off the calibration by more than the bounds
    # Co-located speculative steps by draft depth (``StepDrift.depth``: the step's largest K, in powers of two)
    by_depth: dict[int, float] = field(default_factory=dict)
    depth_steps: dict[int, int] = field(default_factory=dict)


@dataclass
class StepDrift:
    """How far real steps run from the calibration, learnt online per batch-size bucket (powers of
    two), separately for plain steps, co-located speculative steps and the separate topology's rounds
    (moving average of measured / calibrated; the plain mean of the first ``1 / weight``
    observations, so that it starts where they are and not pulled towards 1).

    A calibration is a few seconds at one moment; on a shared machine plain steps were measured
    16% cheaper ten minutes later while speculative steps matched, which flipped decisions near
    break-even. Per batch bucket, because the error of a calibration interpolated between grid
    batches depends on the batch: a factor learnt at batch 1 made speculation look cheap at batch
    16. Per topology, because the separate topology's rounds run in other processes than the
    calibration's: served here they ran 0.67-1.14x as fast as co-located steps from one start to
    the next, which no price timed in one process sees (BENCHMARKS.md, "Auto picks its topology
    and K from served costs"). Only the
    factors' differences change a decision, so they apply once plain steps and one speculative kind
    have been seen ``min_steps`` times in the bucket (a drift learnt on one side alone would make
    that side look cheaper than the other for no measured reason); a speculative kind not yet
    measured takes the other's factor where that makes it dearer (``_borrowed``). Steps off by more
    than ``bounds`` are not drift but a calibration of other hardware (or a synthetic one): while they
    are more than a tenth of a bucket's recent steps, the bucket keeps the calibration as it is. Recent,
    not all: a served replica's first requests (cold start, warm-up stalls) are outliers too, and must
    not switch the correction off for the replica's life.

    The speculative kinds are learnt relative to plain steps: each one's measured / calibrated over the
    plain factor of that moment, priced at plain * that (before the bucket has ``min_steps`` plain steps,
    absolute, and made relative once it has: ``_rebase``). This host's speed moves by 10-25% over minutes
    (a phase of the machine, the same for every kind of step), and an absolute factor per kind compared
    a kind learnt in a slow phase with one learnt in a fast phase: the budgeted planner, running plain
    through a fast phase, learnt plain at 0.87-0.91 while its speculative factors stayed at the 1.03-1.19
    of a slow phase minutes before, so it priced speculation 15-30% dear and ran plain at a batch where
    K=2 measured 1.24x. Relative, a phase moves every kind with plain.

    Co-located speculative steps are also learnt by draft depth (the step's largest K, bucketed in
    powers of two), and a depth seen ``min_steps`` times prices with its own factor (an unseen one with all
    depths', where that makes it dearer): one factor for every K let the calibration's error at one depth
    price every other. On a host whose draft forwards ran slower than calibrated beyond the first (batch
    4: K=1 steps at 1.01x their price, K=2 at 1.07-1.11x, K=3-4 at 1.1-1.4x), the planner's deep plans
    were priced by the shallow steps' factor, went to a mean K of 4.4 where K=1 was best, and measured
    0.78x of it.
    """

    weight: float = 0.05  # per observed step
    min_steps: int = 20
    # A calibration 2x dear is still this machine's: on an Intel Xeon host the budget bench's calibration priced
    # batch-8 plain steps at 2.1-2.3x what they took (0.44-0.48), and a bound at 0.5 left exactly those steps out
    bounds: tuple[float, float] = (0.25, 2.0)
    buckets: dict[int, _Drift] = field(default_factory=dict)
    version: int = 0  # moves whenever the factors may have: what a price memoised under it is valid for

    def take(self, other: StepDrift) -> None:
        """Hold ``other``'s estimates from now on (what cost models holding this object price with)."""
        self.weight, self.min_steps, self.bounds, self.buckets = other.weight, other.min_steps, other.bounds, \
            other.buckets
        self.version += 1

    @staticmethod
    def bucket(batch: float) -> int:
        return max(0, math.ceil(math.log2(max(batch, 1.0))))

    @staticmethod
    def depth(k: int) -> int:
        """A speculative step's depth bucket: its largest K rounded up to a power of two (1, 2, 4, 8, ...)."""
        return 1 << (max(k, 1) - 1).bit_length()

    def factor(self, k: int, batch: float = 1, topology: str = "colocated") -> float:
        d = self._learnt(batch)
        if d is None:
            return 1.0
        colocated, separate = d.spec_steps >= self.min_steps, d.separate_steps >= self.min_steps
        if k == 0:
            return d.plain
        if topology == "separate":
            # unmeasured, its rounds are the co-located steps of their depth plus hops: priced with all co-located
            # steps' factor, a separate K=1 round looked cheaper than a co-located K=1 step (1.08 against 1.52, served
            # family, batch 8), and took a quarter of auto's requests there
            return d.plain * (d.separate if separate else _borrowed(self._colocated(d, k)))
        if not colocated:
            return d.plain * _borrowed(d.separate)
        return d.plain * self._colocated(d, k)

    def _learnt(self, batch: float) -> _Drift | None:
        """The factors that price ``batch``: its bucket's once they apply (plain and a speculative kind seen
        ``min_steps`` times), else an adjacent bucket's; None (the calibration as is) where neither has them,
        or where the batch's own bucket is off the calibration. Why the neighbour: a c=16 load's requests
        were priced at batch 17-20 (the rows expected to join them), a bucket no step had run in, at the
        calibration, while batch 9-16 had learnt plain steps at 1.56x it and K=2 steps at 1.95x plain:
        priced 1.15x, they followed the load into the co-located pool, whose adaptive K ran 86% of their
        steps plain, and auto served 0.96x of plain. Not further than one power of two: a factor learnt
        at batch 1 made speculation look cheap at batch 16."""
        home = self.bucket(batch)
        own = self.buckets.get(home)
        if own is not None and own.outlier_rate > 0.1:
            return None
        for near in (home, home - 1, home + 1):
            d = self.buckets.get(near)
            if d is not None and d.outlier_rate <= 0.1 and d.plain_steps >= self.min_steps and \
                    max(d.spec_steps, d.separate_steps) >= self.min_steps:
                return d
        return None

    def _colocated(self, d: _Drift, k: int) -> float:
        """Co-located steps' factor relative to plain at K=``k``: its depth's own, once measured, else all
        depths' (``_borrowed``)."""
        depth = self.depth(k)
        return d.by_depth[depth] if d.depth_steps.get(depth, 0) >= self.min_steps else _borrowed(d.spec)

    def measured(self, batch: float, kind: str) -> bool:
        """Have served steps of ``kind`` ("plain", "colocated", "separate") been seen ``min_steps``
        times in ``batch``'s bucket?"""
        d = self.buckets.get(self.bucket(batch))
        # a bucket off the calibration by more than the bounds learns nothing from more of its steps
        return d is not None and (getattr(d, _STEPS[kind]) >= self.min_steps or d.outlier_rate > 0.1)

    def explored(self, k: int, batch: float, topology: str = "colocated") -> bool:
        """Have speculative steps like a K step at ``batch`` (its depth; the separate topology's rounds)
        been seen ``min_steps`` times in the batch's bucket, or is the bucket off the calibration?"""
        d = self.buckets.get(self.bucket(batch))
        if d is None:
            return False
        if d.outlier_rate > 0.1:
            return True
        if topology == "separate":
            return d.separate_steps >= self.min_steps
        return d.depth_steps.get(self.depth(k), 0) >= self.min_steps

    def observe(self, k: int, measured_s: float, calibrated_s: float, batch: float = 1,
                topology: str = "colocated") -> None:
        if calibrated_s <= 0 or measured_s <= 0:
            return
        self.version += 1
        bucket = self.bucket(batch)
        d = self.buckets.get(bucket)
        if d is None:  # not setdefault: a step should not build a _Drift it throws away
            d = self.buckets[bucket] = _Drift()
        ratio = measured_s / calibrated_s
        outlier = not self.bounds[0] <= ratio <= self.bounds[1]
        d.outlier_rate += self.weight * (outlier - d.outlier_rate)
        if outlier:
            return
        kind = "plain" if k == 0 else topology
        if kind != "plain" and d.plain_steps >= self.min_steps:
            ratio /= d.plain  # relative to plain steps as measured now
        field_, steps = _FACTOR[kind], _STEPS[kind]
        n = getattr(d, steps) + 1
        setattr(d, steps, n)
        setattr(d, field_, self._toward(getattr(d, field_), ratio, n))
        if kind == "colocated":
            depth = self.depth(k)
            m = d.depth_steps[depth] = d.depth_steps.get(depth, 0) + 1
            d.by_depth[depth] = self._toward(d.by_depth.get(depth, 1.0), ratio, m)
        if kind == "plain" and n == self.min_steps:
            self._rebase(d)

    @staticmethod
    def _rebase(d: _Drift) -> None:
        """The bucket's plain factor is established: the speculative factors learnt so far, absolute, become
        relative to it. Learnt against plain's first steps instead (one reference step, or none: 1), the
        budget's warm-up at batch 8 learnt its K=4 steps at 1.11-1.27x plain where they ran ~1.4x, and its plans
        priced them 10-20% under what they took."""
        d.spec /= d.plain if d.spec_steps else 1.0
        d.separate /= d.plain if d.separate_steps else 1.0
        d.by_depth = {depth: f / d.plain for depth, f in d.by_depth.items()}

    def observe_mixed(self, steps: Sequence[int], measured_s: float, step_s: Callable[[int], float],
                      batch: float = 1) -> None:
        """A co-located request whose decode steps ran at several K (adaptive K: ``steps[k]`` of them at K=k,
        index 0 plain) and took ``measured_s`` in all, one step of K priced ``step_s(k)`` by the calibration.
        Its plain steps are priced with plain's factor and the rest of the time teaches the speculative
        steps, as one observation at its most frequent K. Unless they are under ``MIN_SPEC_SHARE`` of its
        calibrated time: what is left would then be mostly the noise of its plain steps, so the request
        teaches its plain steps instead, its speculative ones priced as learnt. Why: served auto requests
        that adaptive K moved between K=0 and K>0 taught nothing, only requests of one K did: on the tiny
        family at batch 8, of ~190 auto requests in the co-located pool 8 taught the drift (BENCHMARKS.md,
        "What the replica declined"); and a fresh server's c=16 load on code, routed co-located where
        adaptive K ran most of its steps plain, taught nothing for a round of 64 requests while its
        calibration priced batch 16 a third under what its steps took."""
        plain_s = steps[0] * step_s(0) if steps else 0.0
        spec = {k: n for k, n in enumerate(steps) if k and n}
        spec_s = sum(n * step_s(k) for k, n in spec.items())
        if not spec:
            return
        top = max(spec, key=spec.get)
        if spec_s < MIN_SPEC_SHARE * (plain_s + spec_s):
            self.observe(0, measured_s - self.factor(top, batch) * spec_s, plain_s, batch)
            return
        d = self.buckets.get(self.bucket(batch))
        plain_factor = d.plain if d is not None else 1.0
        self.observe(top, measured_s - plain_factor * plain_s, spec_s, batch)

    def _toward(self, factor: float, ratio: float, n: int) -> float:
        """A factor after its n-th observation: the plain mean of the first 1 / weight, a moving average after."""
        return factor + max(self.weight, 1.0 / n) * (ratio - factor)


def _borrowed(factor: float) -> float:
    """A factor learnt on other steps (another depth, the other topology), as it prices steps not measured: where
    it makes them dearer. Cheaper needs their own steps: served K=4 steps at batch 9-16 ran 0.83x their price
    relative to plain, and K=1-2 steps priced with it there looked 1.2-1.5x plain; auto sent a c=16 load at T=1
    to them while co-located measured 0.79x plain (p99 TPOT 1.35x plain's)."""
    return max(1.0, factor)


# A step kind's factor and count in a `_Drift`.
_FACTOR = {"plain": "plain", "colocated": "spec", "separate": "separate"}
_STEPS = {"plain": "plain_steps", "colocated": "spec_steps", "separate": "separate_steps"}

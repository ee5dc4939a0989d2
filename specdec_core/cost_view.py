"""One cost view: the step costs a speculative decision is priced with, wherever it is made.

The router (which pool, which K) and an engine's adaptive K (which K this step) price the same
request with the same ``CostView``: the calibrated step costs of the greedy path and of the
sampling path (drawing from the draft's distributions and the rejection sampler cost more per step
than argmaxes: +15-20% of a batch-1 step here; a batch of both, by its share of sampled rows), priced
at the request's context rounded up to ``CONTEXT_BUCKET`` tokens, times the ``StepDrift`` of real
steps from the calibration. In serving the router owns the drift (it measures both pools' served
steps, the replicas' loops and streaming included) and each adaptive request carries a copy to the
replica, which prices with it (``adopt``); an engine on its own learns its drift from its own steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec_core.acceptance import TrafficClass, temperature_bucket
from specdec_core.costmodel import CostModel
from specdec_core.drift import StepDrift
from specdec_core.step_costs import StepCosts

CONTEXT_BUCKET = 64  # tokens: a request is priced at its context rounded up to this
GREEDY_BUCKET = temperature_bucket(0.0)
SHARE_STEPS = 8  # a batch's share of sampled rows is priced in eighths


class CostView:
    def __init__(self, costs: StepCosts, sampled_costs: StepCosts | None = None, drift: StepDrift | None = None):
        self.costs = costs
        self.sampled_costs = sampled_costs or costs  # without its own: sampled requests at greedy costs
        self.drift = drift if drift is not None else StepDrift()
        self._models: dict[tuple[float, int], CostModel] = {}

    def model(self, greedy: bool, context_len: int = 0) -> CostModel:
        """The cost model of one sampling path at a context."""
        return self.model_at(0.0 if greedy else 1.0, context_len)

    def model_at(self, sampled_share: float, context_len: int = 0) -> CostModel:
        """The cost model of a batch ``sampled_share`` of whose rows sample (in ``SHARE_STEPS``), at a
        context (cached per share and context bucket, so a step does not rebuild a grid per request)."""
        share = round(sampled_share * SHARE_STEPS) / SHARE_STEPS
        key = (share, -(-context_len // CONTEXT_BUCKET))
        model = self._models.get(key)
        if model is None:
            base = self.costs if share == 0 or self.sampled_costs is self.costs else \
                self.sampled_costs if share == 1 else self.costs.blend(self.sampled_costs, share)
            model = CostModel(base.at_context(key[1] * CONTEXT_BUCKET), drift=self.drift)
            self._models[key] = model
        return model

    def model_for(self, cls: TrafficClass, context_len: int = 0) -> CostModel:
        return self.model(cls.temperature_bucket == GREEDY_BUCKET, context_len)

    def model_for_batch(self, classes: Sequence[TrafficClass], context_len: int = 0) -> CostModel:
        """A step's cost model: its rows verify on their own paths, so it is priced by its share of sampled
        rows. A batch of half greedy, half T=1 rows at batch 4 (memory-bound family) ran its K=2 steps at
        0.76x their price on the sampling path and its plain steps at 0.83-0.88x: priced as sampled
        whenever one row was, speculation looked 8-14% dear beside plain; at the blend, within 5%."""
        sampled = sum(1 for c in classes if c.temperature_bucket != GREEDY_BUCKET)
        return self.model_at(sampled / max(1, len(classes)), context_len)

    def adopt(self, drift: StepDrift) -> None:
        """Price with another owner's drift from now on (a replica adopting the router's, with every
        adaptive request): taken into the drift the cached models hold, so that the cache survives."""
        self.drift.take(drift)

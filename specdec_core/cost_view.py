"""One cost view: the step costs a speculative decision is priced with, wherever it is made.

The router (which pool, which K) and an engine's adaptive K (which K this step) price the same
request with the same ``CostView``: the calibrated step costs of the greedy path and of the
sampling path (drawing from the draft's distributions and the rejection sampler cost more per step
than argmaxes: +15-20% of a batch-1 step here), priced at the request's context rounded up to
``CONTEXT_BUCKET`` tokens, times the ``StepDrift`` of real steps from the calibration. In serving
the router owns the drift (it measures both pools' served steps, the replicas' loops and streaming
included) and each adaptive request carries a copy to the replica, which prices with it
(``adopt``); an engine on its own learns its drift from its own steps.
"""

from __future__ import annotations

from specdec_core.acceptance import TrafficClass, temperature_bucket
from specdec_core.costmodel import CostModel, StepCosts
from specdec_core.drift import StepDrift

CONTEXT_BUCKET = 64  # tokens: a request is priced at its context rounded up to this
GREEDY_BUCKET = temperature_bucket(0.0)


class CostView:
    def __init__(self, costs: StepCosts, sampled_costs: StepCosts | None = None, drift: StepDrift | None = None):
        self.costs = costs
        self.sampled_costs = sampled_costs or costs  # without its own: sampled requests at greedy costs
        self.drift = drift if drift is not None else StepDrift()
        self._models: dict[tuple[bool, int], CostModel] = {}

    def model(self, greedy: bool, context_len: int = 0) -> CostModel:
        """The cost model of one sampling path at a context (cached per context bucket, so a step does
        not rebuild a grid per request)."""
        key = (greedy, -(-context_len // CONTEXT_BUCKET))
        model = self._models.get(key)
        if model is None:
            base = self.costs if greedy else self.sampled_costs
            model = CostModel(base.at_context(key[1] * CONTEXT_BUCKET), drift=self.drift)
            self._models[key] = model
        return model

    def model_for(self, cls: TrafficClass, context_len: int = 0) -> CostModel:
        return self.model(cls.temperature_bucket == GREEDY_BUCKET, context_len)

    def adopt(self, drift: StepDrift) -> None:
        """Price with another owner's drift from now on (a replica adopting the router's, with every
        adaptive request): taken into the drift the cached models hold, so that the cache survives."""
        self.drift.take(drift)

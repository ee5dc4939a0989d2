"""Replica autoscaling for one pool (plain, colocated or separate), by the traffic the router sends it.

target replicas = ceil(ongoing / target_ongoing_per_replica), bounded by
[min_replicas, max_replicas], applied only after the wish has held for
upscale_delay_s (up) or downscale_delay_s (down); a wish that changes direction
or returns to the current count restarts the clock, so a load hovering at a
boundary does not flap. The pure core is `decide_replicas`; the delay clock
lives in the returned state, so tests drive it with a fake clock.

Ray Serve 2.60 wiring (verified in ray/serve/config.py and autoscaling_policy.py):

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      target_ongoing_requests: 8        # used when policy_kwargs omit it
      upscale_delay_s: 0                # Serve applies its own delays *after* a
      downscale_delay_s: 0              # custom policy; zero them or they add to ours
      policy:
        policy_function: autoscaling.scaling:PoolAutoscalingPolicy
        policy_kwargs: {upscale_delay_s: 5, downscale_delay_s: 60, metric: active_sequences}

`policy_function: autoscaling.scaling:pool_autoscaling_policy` is the same with
default kwargs. Serve calls the policy with an `AutoscalingContext` and wants
(replicas, policy_state); it instantiates a class once with `policy_kwargs`,
still clamps to min/max and skips the policy when scaling up from zero.
`metric` names a value replicas report from `record_autoscaling_stats()` (e.g.
the engine loop's active sequences); without it, Serve's ongoing requests count.

Serve pickles this module by value into the controller, so it imports nothing
from the project (modules it imported would have to be importable there).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Our keys in Serve's policy_state; Serve keeps its own keys there too.
_DIRECTION = "pool_pending_direction"  # +1 wants up, -1 wants down
_SINCE = "pool_pending_since"


@dataclass(frozen=True)
class PoolScalingConfig:
    target_ongoing_per_replica: float = 8.0
    min_replicas: int = 1
    max_replicas: int = 4
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0


def desired_replicas(ongoing_requests: float, config: PoolScalingConfig) -> int:
    want = math.ceil(ongoing_requests / config.target_ongoing_per_replica)
    return min(max(want, config.min_replicas), config.max_replicas)


def decide_replicas(
    now: float,
    current_replicas: int,
    ongoing_requests: float,
    config: PoolScalingConfig,
    state: Mapping[str, Any],
) -> tuple[int, dict[str, Any]]:
    """(replicas to run, new state). Unknown keys in `state` pass through."""
    want = desired_replicas(ongoing_requests, config)
    new_state = {k: v for k, v in state.items() if k not in (_DIRECTION, _SINCE)}
    if want == current_replicas:
        return current_replicas, new_state
    direction = 1 if want > current_replicas else -1
    since = state[_SINCE] if state.get(_DIRECTION) == direction else now
    delay = config.upscale_delay_s if direction > 0 else config.downscale_delay_s
    if now - since >= delay:
        return want, new_state
    return current_replicas, {**new_state, _DIRECTION: direction, _SINCE: since}


class PoolAutoscalingPolicy:
    """Ray Serve custom autoscaling policy (class form, configured by policy_kwargs)."""

    def __init__(
        self,
        target_ongoing_per_replica: float | None = None,
        upscale_delay_s: float = PoolScalingConfig.upscale_delay_s,
        downscale_delay_s: float = PoolScalingConfig.downscale_delay_s,
        metric: str | None = None,
    ) -> None:
        self.target_ongoing_per_replica = target_ongoing_per_replica
        self.upscale_delay_s = upscale_delay_s
        self.downscale_delay_s = downscale_delay_s
        self.metric = metric

    def _ongoing(self, ctx: Any) -> float:
        per_replica = (ctx.aggregated_metrics or {}).get(self.metric) if self.metric else None
        return float(sum(per_replica.values())) if per_replica else float(ctx.total_num_requests)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        config = PoolScalingConfig(
            target_ongoing_per_replica=self.target_ongoing_per_replica or ctx.config.get_target_ongoing_requests(),
            min_replicas=ctx.capacity_adjusted_min_replicas,
            max_replicas=ctx.capacity_adjusted_max_replicas,
            upscale_delay_s=self.upscale_delay_s,
            downscale_delay_s=self.downscale_delay_s,
        )
        now = ctx.current_time if ctx.current_time is not None else time.time()
        return decide_replicas(now, ctx.target_num_replicas, self._ongoing(ctx), config, ctx.policy_state)


def pool_autoscaling_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Function form with default kwargs (target from autoscaling_config.target_ongoing_requests)."""
    return PoolAutoscalingPolicy()(ctx)

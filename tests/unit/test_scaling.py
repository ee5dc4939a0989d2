"""Pool autoscaling under a fake clock, and the Ray Serve 2.60 policy entry points."""

import pytest
from ray.serve import config as serve_config

from autoscaling.scaling import (
    PoolAutoscalingPolicy,
    PoolScalingConfig,
    decide_replicas,
    desired_replicas,
    pool_autoscaling_policy,
)

CFG = PoolScalingConfig(target_ongoing_per_replica=8, min_replicas=1, max_replicas=4, upscale_delay_s=10,
                        downscale_delay_s=60)


def drive(loads, replicas=1, state=None, tick=1.0, cfg=CFG):
    """Feed one ongoing-request count per tick; return the replica count after each tick."""
    state, out = dict(state or {}), []
    for i, ongoing in enumerate(loads):
        replicas, state = decide_replicas(i * tick, replicas, ongoing, cfg, state)
        out.append(replicas)
    return out


def test_desired_replicas_bounds():
    assert [desired_replicas(n, CFG) for n in (0, 1, 8, 9, 24, 25, 1000)] == [1, 1, 1, 2, 3, 4, 4]


def test_scale_up_after_upscale_delay():
    out = drive([20] * 15)
    assert out[:10] == [1] * 10  # t = 0..9: waiting
    assert out[10:] == [3] * 5  # t = 10: delay elapsed


def test_scale_down_after_downscale_delay():
    out = drive([2] * 70, replicas=3)
    assert out[59] == 3 and out[60] == 1


def test_no_flapping_at_a_boundary():
    # load hovers at the 2/3-replica boundary: every reversal restarts the clock
    out = drive([17, 15] * 50, replicas=2)
    assert set(out) == {2}
    # a dip shorter than the downscale delay does not scale down
    out = drive([20] * 5 + [2] * 30 + [20] * 30, replicas=3)
    assert set(out) == {3}


def test_state_passes_through_unknown_keys():
    replicas, state = decide_replicas(0.0, 1, 20, CFG, {"serve_key": 7})
    assert replicas == 1 and state["serve_key"] == 7
    replicas, state = decide_replicas(10.0, 1, 20, CFG, state)
    assert replicas == 3 and state == {"serve_key": 7}


# ---- Ray Serve 2.60 entry points (no cluster needed) ----


def context(ongoing, target_replicas, now, state, metrics=None, **config):
    cfg = serve_config.AutoscalingConfig(
        min_replicas=1, max_replicas=4, target_ongoing_requests=8, upscale_delay_s=0, downscale_delay_s=0, **config
    )
    return serve_config.AutoscalingContext(
        deployment_id=None, deployment_name="colocated", app_name="app", current_num_replicas=target_replicas,
        target_num_replicas=target_replicas, running_replicas=[], total_num_requests=ongoing,
        total_queued_requests=0, aggregated_metrics=metrics or {}, raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state=state,
        last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=cfg,
    )


def test_function_policy_uses_serve_target_and_holds_delay_in_state():
    replicas, state = pool_autoscaling_policy(context(20, 1, now=100.0, state={}))
    assert replicas == 1 and state  # waiting: the clock is in the state
    replicas, state = pool_autoscaling_policy(context(20, 1, now=104.9, state=state))
    assert replicas == 1
    replicas, state = pool_autoscaling_policy(context(20, 1, now=105.0, state=state))
    assert replicas == 3  # default upscale delay 5 s, target 8 per replica


def test_class_policy_reads_custom_metric():
    policy = PoolAutoscalingPolicy(target_ongoing_per_replica=4, upscale_delay_s=0, metric="active_sequences")
    replicas, _ = policy(context(1, 1, now=0.0, state={}, metrics={"active_sequences": {"r1": 6.0, "r2": 5.0}}))
    assert replicas == 3  # 11 sequences / 4
    replicas, _ = policy(context(9, 1, now=0.0, state={}))  # metric absent: Serve's ongoing requests
    assert replicas == 3


def test_serve_wrapper_merges_state_and_adds_no_delay_when_zeroed():
    # Serve 2.60 wraps custom policies with its own delays and factors (private helper)
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    wrapped = _apply_autoscaling_config(pool_autoscaling_policy)
    replicas, state = wrapped(context(20, 1, now=0.0, state={}))
    assert replicas == 1
    replicas, state = wrapped(context(20, 1, now=5.0, state=state))
    assert replicas == 3


@pytest.mark.parametrize("name", ["pool_autoscaling_policy", "PoolAutoscalingPolicy"])
def test_serve_accepts_the_import_paths(name):
    from ray.serve._private.autoscaling_state import _resolve_policy_callable  # what the controller calls

    policy = serve_config.AutoscalingPolicy(policy_function=f"autoscaling.scaling:{name}",
                                            policy_kwargs={"upscale_delay_s": 1.0})
    replicas, _ = _resolve_policy_callable(policy)(context(20, 1, now=0.0, state={}))
    assert replicas == 1  # waiting out the upscale delay

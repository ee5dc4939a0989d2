"""The regime table: one case per label, first matching row wins."""

from autoscaling.regimes import REGIMES, RegimeEvidence, RoutingThresholds, classify_regime


def test_classify_regime_table():
    th = RoutingThresholds()
    base = dict(temperature=0.0, prompt_tokens=64, max_tokens=256, context_limit=2048, acceptance=0.8,
                evidence=1000.0, cost_ratio=0.1, speedup=0.9, speedup_batch1=0.9, speedup_no_hop=0.9,
                speedup_short_context=0.9)
    cases = [
        ({"max_tokens": 4, "speedup": 2.0}, "prefill_heavy"),
        ({"speedup": 1.5}, "long_context"),  # pays only at this context
        ({"speedup_short_context": 1.5, "speedup_batch1": 1.5}, "long_context"),  # pays only at a short one
        ({"speedup": 1.5, "speedup_short_context": 1.5}, "favorable"),
        ({"speedup_no_hop": 1.5}, "orchestration_overhead"),
        ({"speedup_batch1": 1.5}, "large_batch"),
        ({"acceptance": 0.2, "temperature": 1.0}, "high_entropy"),
        ({"acceptance": 0.2}, "domain_mismatch"),
        ({"cost_ratio": 0.85}, "expensive_draft"),
        ({"acceptance": 0.55, "cost_ratio": 0.6}, "expensive_draft"),
        ({}, "no_gain"),
    ]
    for change, regime in cases:
        assert classify_regime(RegimeEvidence(**{**base, **change}), th) == regime
    assert {r for _, r in cases} == set(REGIMES) - {"unknown"}  # unknown: no pool priced it

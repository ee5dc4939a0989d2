"""What the router's state learns from served requests (``deployments/route_state.py``,
``deployments/load_lessons.py``): the served drift
from their step times, at the batch they decoded in; the rows that join a request while it decodes; what
the pools' adaptive K declined, window by window as requests decode; and how each lesson moves routing."""

from __future__ import annotations

import pytest
from routes import ALL, route, route_state, served_stats
from served import synthetic_costs

from autoscaling.routing import PoolLoad
from deployments.messages import Progress
from deployments.regimes_map import regimes_map
from specdec_core.acceptance import TrafficClass
from specdec_core.stats import RequestStats


def test_served_step_times_correct_the_routing():
    """At batch 9 the engine-step costs send auto traffic to the plain pool. Served plain requests
    then measure 2.5x their calibrated step (the serving loop's per-step cost; more than an engine's
    own drift bounds believe) while co-located speculative steps match theirs: the router learns it
    and routes speculation there too."""
    st = route_state(costs=synthetic_costs())
    loads = {**ALL, "colocated": PoolLoad(active=8), "separate": PoolLoad(active=12)}
    assert route(loads, state=st).pool == "plain"
    cm, batch = st.cost_model(), loads["colocated"].joined_batch()
    plain = served_stats(k=0, decode_steps=40)
    spec = served_stats(k=4, decode_steps=10, budget_tail=True)  # ends on a K=0 step: still a K=4 request
    assert spec.plain_steps == 2 and spec.mean_acceptance_length == 3.0
    for _ in range(30):
        st.observe_timing("separate", batch, spec, 1.0)  # hops: not a step-cost drift
    assert route(loads, state=st).pool == "plain"
    for _ in range(30):
        st.observe_timing("plain", batch, plain, 2.5 * cm.calibrated_step_time(batch, 0))
        st.observe_timing("colocated", batch, spec, cm.calibrated_step_time(batch, 4) / 3.0)
    r = route(loads, state=st)
    assert (r.pool, r.decision.regime) == ("colocated", "favorable") and r.decision.predicted_speedup > 1.2
    st.set_costs(synthetic_costs(), "recalibrated")  # new costs: what was learnt is dropped
    assert route(loads, state=st).pool == "plain"


def test_auto_requests_that_adaptive_k_moved_between_k_teach_the_served_drift():
    """Served auto requests in the co-located pool ran most of their steps plain (adaptive K went to
    K=0) and their K=3 steps took 1.6x their calibrated time: the router learns that from their steps of
    each K, the plain ones priced with plain's measured factor, and stops sending the class there."""
    st = route_state(costs=synthetic_costs())
    idle = {"plain": PoolLoad(), "colocated": PoolLoad()}
    first = route(idle, state=st)
    assert (first.pool, first.decision.k) == ("colocated", 3) and first.decision.predicted_speedup > 1.3
    cm = st.cost_model()
    mixed = served_stats(k=3, decode_steps=10, plain_decode=30)  # 10 K=3 steps accepting 2 each, 30 plain
    measured = 30 * 1.1 * cm.calibrated_step_time(1, 0) + 10 * 1.1 * 1.6 * cm.calibrated_step_time(1, 3)
    for _ in range(30):
        st.observe_timing("plain", 1, served_stats(k=0, decode_steps=40), 1.1 * cm.calibrated_step_time(1, 0))
        st.observe_timing("colocated", 1, mixed, measured / (30 + 10 + 20))
    drift = regimes_map(st, idle)["costs"]["drift"][0]
    assert drift["spec_steps"] == 30 and drift["spec"] == pytest.approx(1.6)
    after = route(idle, state=st)
    assert after.pool == "plain", after.decision


def test_a_pool_whose_adaptive_k_ran_a_class_plain_is_not_sent_more_of_it_until_the_lesson_fades():
    """The router prices K=3 in the co-located pool at 1.38x, but that pool's adaptive K ran 88% of the
    steps of the greedy auto requests sent there plain (its measured speculative steps lost to its plain
    ones): the class goes to the plain pool, saying why, while another class and fixed-K requests still
    go there; two minutes later the lesson has faded and the class is offered speculation again."""
    now = [0.0]
    st = route_state(costs=synthetic_costs(), clock=lambda: now[0])
    idle = {"plain": PoolLoad(), "colocated": PoolLoad()}
    assert route(idle, state=st).pool == "colocated"
    declined = served_stats(k=3, decode_steps=4, plain_decode=30)
    for _ in range(5):
        st.lessons.learn_declined("colocated", 1, TrafficClass.of("d", 0.0), Progress.of(declined))
    assert st.lessons.declined("colocated", 1, TrafficClass.of("d", 0.0)) == pytest.approx(0.88 * (1 - 0.8 ** 5),
                                                                                        abs=0.01)
    r = route(idle, state=st)
    assert r.pool == "plain" and "adaptive K ran such requests plain" in r.decision.reason, r.decision
    (lesson,) = regimes_map(st, idle)["declined"]
    assert (lesson["pool"], lesson["batch_bucket"], lesson["class"]["temperature_bucket"]) == ("colocated", 0, "greedy")
    assert route(idle, state=st, temperature=1.0).pool == "colocated"
    assert route(idle, state=st, mode="speculative").pool == "colocated"
    now[0] += 120.0
    assert route(idle, state=st).pool == "colocated"


def test_a_decline_is_learnt_window_by_window_each_worth_its_share_of_a_window():
    """Requests teach what their pool's adaptive K ran plain as they decode, a window of their decode steps at
    a time (their deltas' progress), not once they finish: four windows in which 14 of 16 steps ran plain
    send the class plain. A request's last, shorter window moves the lesson by its share of a window."""
    cls, idle = TrafficClass.of("d", 0.0), {"plain": PoolLoad(), "colocated": PoolLoad()}
    st = route_state(costs=synthetic_costs())
    window = Progress(plain_steps=14, verify_steps=2, batch_rows=16)
    for n in range(1, 5):
        assert route(idle, state=st).pool == "colocated"
        st.lessons.learn_declined("colocated", 1, cls, window)
        assert st.lessons.declined("colocated", 1, cls) == pytest.approx(14 / 16 * (1 - 0.8 ** n))
    assert route(idle, state=st).pool == "plain"
    other = TrafficClass.of("d", 1.0)
    st.lessons.learn_declined("colocated", 1, other, Progress(plain_steps=4, verify_steps=0, batch_rows=4))
    assert st.lessons.declined("colocated", 1, other) == pytest.approx(0.2 * 4 / 16)
    st.lessons.learn_declined("colocated", 1, other, Progress())  # no decode step: nothing learnt
    assert st.lessons.declined("colocated", 1, other) == pytest.approx(0.2 * 4 / 16)


def test_on_shared_cores_a_pools_decline_stands_for_the_other_and_co_located_binds_separate():
    """The co-located pool's adaptive K ran the class plain. On cores of their own, the separate pool is
    still offered (its draft runs elsewhere); on shared cores the same drafts and verifies would run on
    the same cores, so the class goes plain, even once the separate pool has a lesson of its own."""
    cls = TrafficClass.of("d", 0.0)
    pools = {"plain": PoolLoad(), "colocated": PoolLoad(), "separate": PoolLoad()}
    declined = served_stats(k=3, decode_steps=4, plain_decode=30)
    for shared in (False, True):
        st = route_state(costs=synthetic_costs(), shared_compute=shared)
        for _ in range(5):
            st.lessons.learn_declined("colocated", 1, cls, Progress.of(declined))
        r = route(pools, state=st)
        if not shared:
            assert r.pool == "separate", r.decision
            continue
        assert r.pool == "plain", r.decision
        assert st.lessons.declined("separate", 1, cls) == st.lessons.declined("colocated", 1, cls)
        assert route(pools, state=st, temperature=1.0).pool != "plain"  # another class: no lesson
        for _ in range(5):  # a lesson of its own, that its adaptive K kept speculating, does not lift it:
            st.lessons.learn_declined("separate", 1, cls, Progress.of(served_stats(k=2, decode_steps=20)))
        assert route(pools, state=st).pool == "plain"  # its rounds are the co-located pool's forwards plus hops
        other = TrafficClass.of("d", 1.0)
        for _ in range(5):  # the other way round, the separate pool's verdict stands only while co-located has none
            st.lessons.learn_declined("separate", 1, other, Progress.of(declined))
        assert st.lessons.declined("colocated", 1, other) == st.lessons.declined("separate", 1, other) >= 0.5
        for _ in range(5):
            st.lessons.learn_declined("colocated", 1, other, Progress.of(served_stats(k=2, decode_steps=20)))
        assert st.lessons.declined("colocated", 1, other) < 0.5 <= st.lessons.declined("separate", 1, other)
        assert route(pools, state=st, temperature=1.0).pool == "colocated"


def test_served_timing_is_learnt_at_the_batch_the_request_decoded_in():
    """A request that joined an idle pool (batch 1) and then decoded beside seven others teaches the
    drift of batch 8, not of batch 1: its steps cost batch-8 steps."""
    st = route_state(costs=synthetic_costs())
    cm = st.cost_model()
    plain = served_stats(k=0, decode_steps=40)
    plain.decode_steps, plain.decode_batch_rows = 40, 40 * 8
    for _ in range(5):
        st.learn("plain", 1, TrafficClass.of("d", 0.0), plain, cm.calibrated_step_time(8, 0), migrated=False)
    drift = regimes_map(st, {"plain": PoolLoad()})["costs"]["drift"]
    assert list(drift) == [3] and drift[3]["plain"] == pytest.approx(1.0), drift  # bucket of batch 8, as calibrated


def test_served_timing_is_priced_at_the_share_of_sampled_rows_it_decoded_beside():
    """A greedy request that decoded in batches half of whose rows sampled ran steps that cost in between
    the greedy and the sampling path (the verifier takes each row's own path in one step). Priced at that
    blend, its steps are as calibrated; priced on its own path they read as a 25% drift that no greedy
    batch has."""
    import dataclasses

    greedy = synthetic_costs()
    sampled = dataclasses.replace(greedy, target_s=tuple(tuple(1.5 * t for t in row) for row in greedy.target_s))
    st = route_state()
    st.set_costs(greedy, "test", sampled_costs=sampled)
    beside = served_stats(k=0, decode_steps=40)
    beside.decode_steps, beside.decode_batch_rows, beside.decode_sampled_rows = 40, 40 * 8, 40 * 4
    assert beside.sampled_share == 0.5
    blend_step = st.view.model_at(0.5).calibrated_step_time(8, 0)
    assert blend_step == pytest.approx(1.25 * st.view.model_at(0.0).calibrated_step_time(8, 0))
    for _ in range(5):
        st.learn("plain", 8, TrafficClass.of("d", 0.0), beside, blend_step, migrated=False)
    drift = regimes_map(st, {"plain": PoolLoad()})["costs"]["drift"]
    assert drift[3]["plain"] == pytest.approx(1.0), drift


def test_a_request_is_priced_at_the_batch_it_will_decode_in():
    """In a burst the first requests join an idle co-located pool and decode beside the ones that follow:
    the router learns how many rows join a request while it decodes (per pool, from finished requests)
    and prices the next one at that batch, not at the batch it joins; the lesson fades once the burst
    is over (fake clock), and /v1/regimes shows it."""
    now = [0.0]
    st = route_state(costs=synthetic_costs(), clock=lambda: now[0])
    idle = {"plain": PoolLoad(), "colocated": PoolLoad()}
    assert route(idle, state=st).pool == "colocated"  # batch 1 pays
    assert route({"plain": PoolLoad(), "colocated": PoolLoad(active=7)}, state=st).pool == "plain"  # batch 8 does not
    burst = served_stats(k=4, decode_steps=12)
    burst.decode_steps, burst.decode_batch_rows = 12, 12 * 8  # joined at batch 1, decoded at batch 8
    for _ in range(10):
        st.learn("colocated", 1, TrafficClass.of("d", 0.0), burst, 0.0, migrated=False)
    assert st.lessons.joining("colocated", 1) == pytest.approx(7 * (1 - 0.8 ** 10))
    assert st.lessons.joining("colocated", 8) == 0.0  # learnt for requests that joined at batch 1
    assert regimes_map(st, idle)["pools"]["colocated"]["joining"] == pytest.approx(st.lessons.joining("colocated", 1))
    r = route(idle, state=st)
    assert r.pool == "plain" and "batch 7" in r.decision.reason, r.decision  # priced where it would decode
    now[0] += 120.0  # four half-lives without a finished request: back to the batch it joins
    assert st.lessons.joining("colocated", 1) < 0.5 and route(idle, state=st).pool == "colocated"


def test_the_router_keeps_how_many_rows_joined_each_request_not_only_their_mean():
    """Requests that joined an idle load at batch 1: some opened a burst (7 rows joined them), some
    ended a drain (none did), one saw 2.5 on average. The router keeps the outcomes with their shares
    (a fractional one split between its two integers), their mean is ``joining``, the routing context's
    loads carry them, and once nothing is learnt the shares fade toward "none joined"."""
    now = [0.0]
    st = route_state(costs=synthetic_costs(), clock=lambda: now[0], shared_compute=True)
    alone = served_stats(k=4, decode_steps=12)
    alone.decode_steps, alone.decode_batch_rows = 12, 12
    cls = TrafficClass.of("d", 0.0)
    for whole in (8.0, 1.0, 8.0, 1.0, 3.5):  # burst, drain, burst, drain, a ramp
        st.learn("colocated", 1, cls, alone, 0.0, migrated=False, whole_load=(1, whole))
    shares = dict(st.lessons.joining_shares("colocated", 1))
    assert set(shares) == {0, 2, 3, 7}, shares
    assert shares[2] == pytest.approx(0.5 * 0.2) and shares[3] == pytest.approx(0.5 * 0.2)
    assert shares[7] > shares[3] and sum(shares.values()) == pytest.approx(1.0)
    assert st.lessons.joining("colocated", 1) == pytest.approx(sum(r * s for r, s in shares.items()))
    loads = st.priced_loads({"plain": PoolLoad(), "colocated": PoolLoad()})
    assert dict(loads["plain"].joining_shares) == pytest.approx(shares)  # the whole load's: every pool
    assert dict(loads["colocated"].decode_batches()) == pytest.approx({1 + r: s for r, s in shares.items()})
    now[0] += 30.0  # one half-life
    faded = dict(st.lessons.joining_shares("colocated", 1))
    assert faded[7] == pytest.approx(shares[7] / 2) and faded[0] == pytest.approx(1 - sum(shares.values()) / 2
                                                                                + shares[0] / 2)


def test_on_shared_cores_the_rows_that_join_a_request_are_the_whole_loads():
    """A burst on shared cores: a request joined an idle system and ran beside seven rows of any pool
    (``whole_load``: per-replica rows when it joined, and their mean while it ran). The router learns
    that the next request to join an idle system decodes at batch 8, where speculation does not pay;
    its own pool's batch (1, alone in the co-located pool) does not teach it, and every pool learns it
    (no pool looks emptier than another for where its requests happened to join)."""
    st = route_state(costs=synthetic_costs(), shared_compute=True)
    idle = {"plain": PoolLoad(), "colocated": PoolLoad()}
    assert route(idle, state=st).pool == "colocated"
    alone = served_stats(k=4, decode_steps=12)
    alone.decode_steps, alone.decode_batch_rows = 12, 12  # its own pool: batch 1 throughout
    for _ in range(10):
        st.learn("colocated", 1, TrafficClass.of("d", 0.0), alone, 0.0, migrated=False, whole_load=(1, 8.0))
    assert st.lessons.joining("colocated", 1) == pytest.approx(7 * (1 - 0.8 ** 10))
    # the whole load's: one lesson for every pool
    assert st.lessons.joining("separate", 1) == pytest.approx(st.lessons.joining("colocated", 1))
    r = route(idle, state=st)
    assert r.pool == "plain" and r.decision.regime == "large_batch", r.decision


def test_on_shared_cores_a_request_beside_another_pools_rows_teaches_no_drift():
    """A plain request that decoded at batch 6 while the whole load averaged 8 rows (two in the
    co-located pool, on the same cores) measured their contention, not its step: where pools share
    their cores it teaches no drift; one that had the cores to itself does, and on cores of their own
    both do."""
    def plain_at(batch: int) -> RequestStats:
        stats = served_stats(k=0, decode_steps=40)
        stats.decode_steps, stats.decode_batch_rows = 40, 40 * batch
        return stats

    for shared, beside, learnt in ((True, True, False), (True, False, True), (False, True, True)):
        st = route_state(costs=synthetic_costs(), shared_compute=shared)
        slow = 1.5 * st.cost_model().calibrated_step_time(6, 0)
        for _ in range(5):
            st.learn("plain", 6, TrafficClass.of("d", 0.0), plain_at(6), slow, migrated=False,
                     whole_load=(6, 8.0 if beside else 6.0))
        drift = regimes_map(st, {"plain": PoolLoad()})["costs"]["drift"]
        assert (3 in drift) == learnt, (shared, beside, drift)
        if learnt:
            assert drift[3]["plain"] == pytest.approx(1.5) and drift[3]["plain_steps"] == 5


def test_the_router_prices_the_whole_request_with_what_each_pools_requests_waited_for():
    """At batch 4 a co-located decode is 1.10x plain's. Plain requests there then measure a 0.5 s TTFT and no
    waits for other requests' prefills; co-located ones 0.25 s and 0.3 s of others' prefills per second of
    their own steps. Once both pools have ``WAITS_MIN_REQUESTS`` of them, the whole request is priced slower
    co-located and goes plain; ``/v1/regimes`` shows the lessons."""
    from deployments.load_lessons import WAITS_MIN_REQUESTS

    st = route_state(costs=synthetic_costs())
    loads = {**ALL, "colocated": PoolLoad(active=3), "separate": PoolLoad(replicas=0)}
    before = route(loads, state=st)
    assert before.pool == "colocated" and before.decision.predicted_speedup == pytest.approx(1.10, abs=0.01)

    def finished(pool: str, ttft_s: float, waits_per_step_s: float, migrated: bool = False) -> None:
        stats = served_stats(k=0, decode_steps=40)  # no draft tokens: the class's acceptance stays as it is
        stats.decode_batch_rows, stats.decode_s = 4 * stats.decode_steps, 1.0
        stats.prefill_wait_s = waits_per_step_s * stats.decode_s
        st.learn(pool, 4, TrafficClass.of("d", 0.0), stats, 0.0, migrated, ttft_s=ttft_s)

    for _ in range(WAITS_MIN_REQUESTS):
        finished("colocated", 0.25, 0.3)
        finished("plain", 0.5, 0.0, migrated=True)  # a migrated request's TTFT holds a re-prefill: not learnt
    for _ in range(WAITS_MIN_REQUESTS - 1):
        finished("plain", 0.5, 0.0)
    assert route(loads, state=st).pool == "colocated"  # plain's side: one request short
    finished("plain", 0.5, 0.0)
    after = route(loads, state=st)
    assert (after.pool, after.decision.regime) == ("plain", "large_batch"), after.decision
    plain_s = 64 * st.cost_model().plain_time_per_token(4)
    whole = (0.5 + plain_s) / (0.25 + 1.3 * plain_s / before.decision.predicted_speedup)
    assert f"predicted speedup {whole:.2f}" in after.decision.reason and whole < 1.0
    lessons = {w["pool"]: w for w in regimes_map(st, loads)["waits"]}
    assert lessons["plain"]["requests"] == lessons["colocated"]["requests"] == WAITS_MIN_REQUESTS
    assert lessons["colocated"]["ttft_s"] == pytest.approx(0.25)
    assert lessons["colocated"]["prefill_wait_ratio"] == pytest.approx(0.3)


def test_a_pool_that_never_measured_its_waits_does_not_win_a_request_for_want_of_them():
    """A lone request: co-located pays 1.38x on its decode steps, and both it and plain have measured their
    waits (co-located's TTFT the longer), so co-located's whole request is priced below its steps. The
    separate topology, the same steps and no waits measured, is priced with co-located's waits, not on its
    steps alone (where it won the request at 1.38x)."""
    from deployments.load_lessons import WAITS_MIN_REQUESTS

    st = route_state(costs=synthetic_costs())
    stats = served_stats(k=0, decode_steps=40)
    stats.decode_s = 1.0
    for _ in range(WAITS_MIN_REQUESTS):
        st.lessons.learn_waits("plain", 1, 0.1, stats)
        st.lessons.learn_waits("colocated", 1, 0.2, stats)
    r = route(state=st)
    assert r.pool == "colocated" and 1.05 < r.decision.predicted_speedup < 1.3, r.decision


def test_a_decline_learnt_at_a_batch_stands_at_larger_batches_that_have_no_lesson_of_their_own():
    """Adaptive K ran 88% of the co-located pool's steps plain at batch 2. A request priced at batch 4 (a
    bucket above, where its pool has no lesson) is not sent there: speculation pays less as the batch grows.
    At batch 1, below the lesson, it is; and a lesson of batch 4's own, that its steps ran speculative, wins."""
    cls = TrafficClass.of("d", 0.0)
    st = route_state(costs=synthetic_costs())
    at_4 = {**ALL, "colocated": PoolLoad(active=3), "separate": PoolLoad(replicas=0)}
    assert route(at_4, state=st).pool == "colocated"
    for _ in range(5):
        st.lessons.learn_declined("colocated", 2, cls, Progress.of(served_stats(k=3, decode_steps=4, plain_decode=30)))
    share = st.lessons.declined("colocated", 2, cls)
    assert share > 0.5
    assert st.lessons.declined("colocated", 4, cls) == st.lessons.declined("colocated", 64, cls) == share
    r = route(at_4, state=st)
    assert r.pool == "plain" and "adaptive K ran such requests plain" in r.decision.reason, r.decision
    assert st.lessons.declined("colocated", 1, cls) == 0.0
    assert route({**at_4, "colocated": PoolLoad()}, state=st).pool == "colocated"
    for _ in range(10):
        st.lessons.learn_declined("colocated", 4, cls, Progress.of(served_stats(k=2, decode_steps=20)))
    assert st.lessons.declined("colocated", 4, cls) < 0.5 and route(at_4, state=st).pool == "colocated"


def test_waits_priced_at_a_bucket_that_has_none_are_the_nearest_smaller_buckets_where_both_pools_measured_them():
    """Waits learnt at batch 4 (bucket 2) price a request at batch 5-8 too, as a pair from one bucket; below
    the lesson, or with plain's side unmeasured, a request is priced on its decode steps alone."""
    from deployments.load_lessons import WAITS_MIN_REQUESTS

    lessons = route_state(costs=synthetic_costs()).lessons
    stats = served_stats(k=0, decode_steps=40)
    stats.decode_s, stats.prefill_wait_s = 1.0, 0.3
    for _ in range(WAITS_MIN_REQUESTS):
        lessons.learn_waits("plain", 4, 0.5, stats)
        lessons.learn_waits("colocated", 4, 0.25, stats)
        lessons.learn_waits("colocated", 8, 0.75, stats)  # co-located's side alone at bucket 3
    at_4 = lessons.waits_beside_plain("colocated", 4)
    assert at_4 is not None and (at_4[0].ttft_s, at_4[1].ttft_s) == pytest.approx((0.5, 0.25))
    assert lessons.waits_beside_plain("colocated", 8) == at_4 == lessons.waits_beside_plain("colocated", 17)
    assert lessons.waits_beside_plain("colocated", 2) is None


def test_a_speculative_pool_whose_waits_are_unmeasured_is_priced_with_the_other_speculative_pools():
    """The separate topology, its waits unmeasured, is priced with co-located's at the same bucket (the same
    prefills of the same target), and its own once it measured them; the plain pool's side is never borrowed."""
    from deployments.load_lessons import WAITS_MIN_REQUESTS

    lessons = route_state(costs=synthetic_costs()).lessons
    stats = served_stats(k=0, decode_steps=40)
    stats.decode_s, stats.prefill_wait_s = 1.0, 0.3
    for _ in range(WAITS_MIN_REQUESTS):
        lessons.learn_waits("colocated", 4, 0.25, stats)
    assert lessons.waits_beside_plain("separate", 4) is None  # plain's side unmeasured
    for _ in range(WAITS_MIN_REQUESTS):
        lessons.learn_waits("plain", 4, 0.5, stats)
    borrowed = lessons.waits_beside_plain("separate", 4)
    assert borrowed == lessons.waits_beside_plain("colocated", 4)
    assert borrowed[1].ttft_s == pytest.approx(0.25)
    for _ in range(WAITS_MIN_REQUESTS):
        lessons.learn_waits("separate", 4, 0.4, stats)
    assert lessons.waits_beside_plain("separate", 4)[1].ttft_s == pytest.approx(0.4)

"""Session affinity (and Ray 2.60's gather bug it works around) and the load generator against the
served app."""

from __future__ import annotations

import json

import pytest
from served import stats

pytestmark = pytest.mark.timeout(300)


def test_session_affinity_gather_regression(server):
    """Concurrent pinned calls from inside one request (asyncio.gather in the Router replica):
    with the workaround (a fresh internal request id per call) they complete, and each session
    lands on the same replica every time; the replica set is the two Target replicas."""
    router = server["router"]
    sessions = [f"affinity-{i}" for i in range(12)]
    first = router.probe_sessions.remote("target", sessions).result(timeout_s=60)
    second = router.probe_sessions.remote("target", list(reversed(sessions))).result(timeout_s=60)
    assert "placement" in first and "placement" in second, (first, second)
    a = [p["replica"] for p in first["placement"]]
    b = [p["replica"] for p in reversed(second["placement"])]
    assert a == b
    from deployments.session_router import owner

    replicas = sorted({r["replica"] for r in stats(server)["target"]})
    assert len(replicas) == 2
    assert a == [owner(s, replicas) for s in sessions]  # rendezvous hashing, computable anywhere
    assert len(set(a)) == 2  # 12 sessions spread over both replicas (fixed ids: deterministic)
    draft = router.probe_sessions.remote("draft", sessions).result(timeout_s=60)
    assert len(draft["placement"]) == len(sessions)


@pytest.mark.skipif(__import__("ray").__version__ != "2.60.0", reason="documents the Ray 2.60 bug")
def test_gather_without_workaround_hangs_in_ray_2_60(server):
    """Canary: if this starts failing, Ray fixed the bug and pinned_gather's workaround can go."""
    out = server["router"].probe_sessions.remote(
        "target", [f"canary-{i}" for i in range(4)], fresh_ids=False, timeout_s=3.0).result(timeout_s=60)
    assert out == {"timed_out": True}
    # the router recovers: the same probe with the workaround works right after
    ok = server["router"].probe_sessions.remote("target", [f"canary-{i}" for i in range(4)]).result(timeout_s=60)
    assert len(ok["placement"]) == 4


def test_serve_load_generator_writes_its_report(server, tmp_path):
    """`specdec-bench serve` against the live app: one pass per mode, every request served."""
    from specdec_bench.cli import main

    main(["serve", "--url", server["url"], "--out", str(tmp_path), "--requests", "3", "--max-tokens", "8",
          "--modes", "plain", "colocated"])
    data = json.loads((tmp_path / "serve.json").read_text())
    assert [p["mode"] for p in data["passes"]] == ["plain", "colocated"]
    for p in data["passes"]:
        assert p["requests"] == p["completed"] == 3 and p["errors"] == 0 and p["output_throughput"] > 0, p
        assert 0 < p["median_ttft_ms"] <= p["p99_ttft_ms"] and 0 < p["median_tpot_ms"] <= p["p99_tpot_ms"], p
        # EOS may end one early
        assert 0 < p["total_output_tokens"] <= 3 * 8 and p["mean_e2el_ms"] > p["mean_ttft_ms"], p
    assert data["config"]["out"] == str(tmp_path)
    assert "| plain |" in (tmp_path / "serve.md").read_text()


def test_serve_load_generator_runs_a_mixed_load_interleaved(server, tmp_path):
    """`specdec-bench serve --mix`: each round holds every profile (prompt set, temperature, user) in
    every mode, and each pass reports its profiles on their own."""
    from specdec_bench.cli import main

    main(["serve", "--url", server["url"], "--out", str(tmp_path), "--requests", "4", "--max-tokens", "6",
          "--concurrency", "2", "--interleave", "--modes", "plain", "colocated",
          "--mix", "prose:0", "code:1:coder"])
    data = json.loads((tmp_path / "serve.json").read_text())
    assert {p["mode"] for p in data["passes"]} == {"plain", "colocated"}
    for p in data["passes"]:
        assert p["completed"] == 4 and p["errors"] == 0, p
        assert {name: q["requests"] for name, q in p["by_profile"].items()} == {"prose:0": 2, "code:1:coder": 2}
        routes = {name: q["routes"] for name, q in p["by_profile"].items()}
        assert all(r == {p["mode"]: 2} for r in routes.values()), routes
    assert "| plain: code:1:coder |" in (tmp_path / "serve.md").read_text()

"""Benchmark smoke tests: the CLI runs a tiny configuration end to end and writes the documented
JSON shape (the real runs are in BENCHMARKS.md)."""

import json
import shutil
import statistics

import pytest

from specdec_bench.cli import main
from specdec_core.step_costs import StepCosts

CELL_KEYS = {
    "regime", "draft", "batch", "temperature", "k", "plain_tok_s", "spec_tok_s", "auto_tok_s", "speedup",
    "auto_vs_best", "acceptance", "cost_ratio", "predicted_speedup", "runs",
}
REGIMES = {"favorable", "high_entropy", "expensive_draft", "domain_mismatch", "large_batch",
           "orchestration_overhead", "long_context", "prefill_heavy", "no_gain", "unknown"}


@pytest.fixture(scope="module")
def family(tiny_models, tmp_path_factory):
    """A model-family folder laid out like models/, built from the tiny test models."""
    root = tmp_path_factory.mktemp("family")
    shutil.copytree(tiny_models["target"], root / "target")
    for name in ("draft", "draft-code", "draft-large"):
        shutil.copytree(tiny_models["draft"], root / name)
    (root / "prompts").mkdir()
    lines = {
        "prose": ["It is a truth universally acknowledged", "In the beginning God created"],
        "code": ["def fibonacci(n):", "for i in range(10):"],
        "repetitive": ["for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\n"],
        "long": ["In the beginning God created the heaven and the earth. " * 8],
    }
    for name, prompts in lines.items():
        (root / "prompts" / f"{name}.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in prompts))
    return root


def test_regimes_quick_writes_documented_json(family, tmp_path):
    main(["regimes", "--quick", "--models", str(family), "--out", str(tmp_path), "--threads", "1", "--reps", "1",
          "--only", "favorable", "domain_mismatch"])
    data = json.loads((tmp_path / "regimes.json").read_text())
    assert {"machine", "config", "cells"} <= set(data)
    assert data["cells"], "no cells ran"
    for cell in data["cells"]:
        assert CELL_KEYS <= set(cell)
        assert cell["regime"] in REGIMES
        assert cell["speedup"] == pytest.approx(cell["spec_tok_s"] / cell["plain_tok_s"])
        # rep by rep against the mode with the better median
        assert len(cell["auto_vs_best_per_rep"]) == cell["runs"]
        assert cell["auto_vs_best"] == pytest.approx(statistics.median(cell["auto_vs_best_per_rep"]))
        assert cell["predicted_speedup"] > 0 and 0 <= cell["acceptance"] <= 1
    assert (tmp_path / "regimes.md").read_text().startswith("# Regime benchmark")
    assert (tmp_path / "predicted_vs_measured.png").stat().st_size > 0


def test_budget_sweep_writes_every_mode_measured_and_predicted(family, tmp_path):
    main(["budget", "--models", str(family), "--out", str(tmp_path), "--threads", "1", "--reps", "1",
          "--batches", "2", "--max-new-tokens", "16"])
    data = json.loads((tmp_path / "budget.json").read_text())
    names = {c["cell"] for c in data["cells"]}
    assert names == {"prose b2", "mixed b2", "mixed-draft b2"}
    # The calibrations the cells planned with, per proposer and path, as calibration files hold them.
    assert set(data["costs"]) == {"draft", "ngram"}
    for paths in data["costs"].values():
        assert {p: StepCosts.from_dict(c).batches for p, c in paths.items()} == {"greedy": (1, 2), "sampled": (1, 2)}
    assert all(c["max_new_tokens"] == 16 for c in data["cells"])
    for cell in data["cells"]:
        modes = {"plain", "k1", "k2", "k4", "k8", "auto", "budget"}
        assert set(cell["tok_s"]) == set(cell["predicted"]) == modes
        assert all(v > 0 for v in cell["tok_s"].values())
        assert cell["speedup"]["plain"] == pytest.approx(1.0) == cell["predicted"]["plain"]
        assert cell["mean_k"]["plain"] == 0 and cell["mean_k"]["k4"] > 0
    # Per row set: where each mode spent its draft tokens (plain none; every set of a mixed cell accounted for).
    mixed = next(c for c in data["cells"] if c["cell"] == "mixed-draft b2")
    assert set(mixed["acceptance_by_rows"]["k4"]) == {"repetitive", "prose"}
    assert all(n == 0 for n, _ in mixed["acceptance_by_rows"]["plain"].values())
    assert all(n > 0 and 0 <= rate <= 1 for n, rate in mixed["acceptance_by_rows"]["k4"].values())
    by_rows = mixed["acceptance_by_rows"]["k4"].values()
    assert sum(n * rate for n, rate in by_rows) / sum(n for n, _ in by_rows) == pytest.approx(mixed["acceptance"]["k4"])
    text = (tmp_path / "budget.md").read_text()
    assert "| prose b2 (16) |" in text and "- mixed-draft b2: budget " in text


def test_context_grid_writes_every_mode_measured_and_predicted(family, tmp_path):
    main(["context", "--models", str(family), "--out", str(tmp_path), "--threads", "1", "--reps", "1",
          "--batches", "1", "2", "--contexts", "16", "48"])
    data = json.loads((tmp_path / "context.json").read_text())
    assert [(c["batch"], c["context"]) for c in data["cells"]] == [(1, 16), (1, 48), (2, 16), (2, 48)]
    assert set(data["costs"]) == {"full", "window"}
    for cell in data["cells"]:
        modes = {"plain", "k2", "k4", "auto", "k2w", "k4w", "autow"}
        assert set(cell["tok_s"]) == set(cell["predicted"]) == set(cell["acceptance"]) == modes
        assert all(v > 0 for v in cell["tok_s"].values())
        assert cell["speedup"]["plain"] == pytest.approx(1.0) == cell["predicted"]["plain"]
        assert cell["acceptance"]["plain"] == 0 and 0 <= cell["acceptance"]["k4w"] <= 1
        assert cell["catch_up_s"]["k4"] > cell["catch_up_s"]["plain"]  # the draft prefilled the prompts
    assert "| 2 | 48 |" in (tmp_path / "context.md").read_text()


def test_predict_writes_regime_map(tmp_path):
    main(["predict", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "predict.json").read_text())
    names = {s["name"] for s in data["scenarios"]}
    assert any("H100" in n for n in names) and any("H200" in n for n in names)
    for s in data["scenarios"]:
        assert len(s["speedup"]) == len(data["acceptances"])
        assert all(len(row) == len(data["batches"]) for row in s["speedup"])


def test_oracle_sweep_on_cpu_sets_acceptance(tmp_path):
    """The GPU script's sweep runs on CPU at small shapes (hidden 256: its draft is a quarter as
    wide), and its oracle draft sets acceptance: a = 0 proposes only wrong tokens, a = 1 only the
    target's own greedy tokens."""
    main(["gpu", "--device", "cpu", "--hidden", "256", "--layers", "2", "--vocab", "256", "--context", "16",
          "--new-tokens", "24", "--batches", "1", "2", "--acceptances", "0", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "regimes_gpu.json").read_text())
    assert {"machine", "config", "costs", "rows"} <= set(data)
    by_a = {}
    for row in data["rows"]:
        assert row["speedup"] == pytest.approx(row["spec_tok_s"] / row["plain_tok_s"])
        assert row["predicted_speedup"] > 0 and row["runs"] == 1
        by_a.setdefault(row["acceptance_target"], []).append(row["acceptance"])
    assert max(by_a[0.0]) == 0.0
    assert min(by_a[1.0]) > 0.8


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_interleaved_orders_are_balanced(n):
    """`serve --interleave` orders its modes so that every mode follows every other equally often
    (a mode right after the separate topology inherits its leftover work) and auto (0) opens."""
    from specdec_bench.load import williams_orders

    rows = williams_orders(n)
    assert rows[0][0] == 0 and all(sorted(r) == list(range(n)) for r in rows)
    follows = {}
    for r in rows:
        for a, b in zip(r, r[1:]):
            follows[a, b] = follows.get((a, b), 0) + 1
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


def test_a_mixed_load_cycles_its_profiles_each_through_its_own_prompts():
    """`serve --mix`: request i is profile i mod n with that profile's temperature and user, and each
    profile walks its own prompt set in order (so every mode of an interleaved round sends the same)."""
    from argparse import Namespace

    from specdec_bench.common import load_prompts
    from specdec_bench.load import Profile, Traffic

    traffic = Traffic(Namespace(mix=["prose:0", "code:1:coder", "prose:1.5:sampler"], prompts="prose",
                                temperature=0.0, user=None))
    prose, code = load_prompts("prose"), load_prompts("code")
    sent = [traffic.request(i) for i in range(6)]
    assert sent[0] == (prose[0], {"temperature": 0.0}) and sent[3] == (prose[1], {"temperature": 0.0})
    assert sent[1] == (code[0], {"temperature": 1.0, "user": "coder"}) and sent[4][0] == code[1]
    assert sent[2] == (prose[0], {"temperature": 1.5, "user": "sampler"})
    assert [traffic.profile(i).name for i in range(3)] == ["prose:0", "code:1:coder", "prose:1.5:sampler"]
    one = Traffic(Namespace(mix=None, prompts="code", temperature=0.7, user="u"))
    assert one.request(2) == (code[2], {"temperature": 0.7, "user": "u"})
    with pytest.raises(ValueError, match="SET:TEMPERATURE"):
        Profile.parse("prose")


def test_fault_bench_measures_each_replica_process_from_when_it_was_warm():
    """A replica alive before the window is warm at its start; a replacement (it started cold, mid
    window) only ``warmup`` seconds after it appeared; one killed before then has no growth."""
    from specdec_bench.faults import rss_growth

    samples = {
        1: [(-120.0, "Draft", 500.0), (0.0, "Draft", 600.0), (600.0, "Draft", 612.0)],
        2: [(-120.0, "Target", 700.0), (59.0, "Target", 720.0)],  # killed at 60 s
        3: [(70.0, "Target", 400.0), (160.0, "Target", 640.0), (190.0, "Target", 650.0), (600.0, "Target", 660.0)],
        4: [(500.0, "PlainPool", 500.0), (600.0, "PlainPool", 700.0)],  # appeared too late to be warm
    }
    rows = {r["pid"]: r for r in rss_growth(samples, warmup_s=120.0)}
    assert rows[1]["warm_mib"] == 600.0 and rows[1]["growth_pct"] == pytest.approx(2.0)
    assert rows[2]["warm_at_s"] == 59.0 and rows[2]["growth_pct"] == 0.0
    assert rows[3]["warm_at_s"] == 190.0 and rows[3]["growth_pct"] == pytest.approx(100 * (660 / 650 - 1))
    assert rows[4]["warm_mib"] is None and rows[4]["growth_pct"] is None


def test_multinode_placement_and_autoscaled_pool_are_valid_configs():
    """The benchmarks' placement (specdec_bench/nodes.py) puts each deployment where its table says,
    keeps the config's own pool options, and Serve accepts the autoscaled plain pool it runs."""
    import argparse

    from deployments.app import _options
    from deployments.config import AppConfig
    from specdec_bench.autoscale import autoscaled
    from specdec_bench.nodes import WORKERS, placement

    args = placement({"target": "t", "draft": "d", "plain": {"max_ongoing_requests": 7}})
    cfg = AppConfig(**args)
    assert cfg.target_deployment.resources == {"target_node": 0.01} and cfg.router.num_replicas == 2
    assert cfg.plain.resources == {"plain_slot": 1.0} and cfg.plain.num_replicas == 2
    assert cfg.plain.max_ongoing_requests == 7  # the config's own option stays
    assert sum(w["plain_slot"] for w in WORKERS.values()) == 2  # one plain replica per worker node
    cli = argparse.Namespace(target_ongoing=4.0, up_delay=5.0, down_delay=20.0)
    scaled = AppConfig(**autoscaled(args, cli))
    ac = _options(scaled.plain, "PlainPool")["autoscaling_config"]
    assert (ac["min_replicas"], ac["max_replicas"]) == (1, 2) and scaled.plain.resources == {"plain_slot": 1.0}
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**ac)


def test_autoscale_summary_times_the_second_replica_from_the_step():
    from specdec_bench.autoscale import summarise

    phases = [("before", 1, 10.0), ("step", 8, 20.0), ("after", 1, 20.0)]
    samples = [(0.0, ["a"]), (12.0, ["a"]), (16.5, ["a", "b"]), (31.0, ["a", "b"]), (44.0, ["b"])]
    results = [(0, True, 48, 5.0), (1, True, 48, 15.0), (1, False, 3, 20.0), (2, True, 48, 40.0)]
    out = summarise(phases, [10.0, 30.0, 50.0], results, samples)
    assert out["second_replica_after_step_s"] == 6.5 and out["replica_nodes_at_peak"] == ["a", "b"]
    assert out["back_to_one_after_step_end_s"] == 14.0
    assert [(p["requests"], p["lost"], p["tok_s"]) for p in out["phases"]] == [(1, 0, 4.8), (2, 1, 2.4), (1, 0, 2.4)]


def test_served_peers_summary_is_the_median_over_repeats_against_vllms_best(tmp_path):
    import yaml

    from specdec_bench.served_peers import family_config, served_peers_markdown, summarise

    def row(server, mode, c, rep, tput):
        return {"server": server, "mode": mode, "concurrency": c, "repeat": rep, "output_throughput": tput,
                "median_ttft_ms": 1.0, "median_tpot_ms": 2.0, "p99_tpot_ms": 3.0, "median_e2el_ms": 4.0,
                "p99_e2el_ms": 5.0, "acceptance_rate": 0.5, "errors": 0, "completed": 8}

    passes = [row("vllm", "vllm-plain", 1, r, t) for r, t in enumerate((100, 300, 200))] + \
             [row("vllm", "vllm-draft", 1, r, t) for r, t in enumerate((150, 150, 150))] + \
             [row("specdec", "auto", 1, r, t) for r, t in enumerate((240, 260, 100))]
    rows = {(r["server"], r["mode"]): r for r in summarise(passes)}
    assert rows["vllm", "vllm-plain"]["tok_s"] == 200 and rows["vllm", "vllm-plain"]["tok_s_max"] == 300
    assert rows["specdec", "auto"]["vs_vllm_best"] == pytest.approx(240 / 200)  # vLLM's best median: plain's
    fam = {"family": "tiny", "target": "t", "draft": "d", "summary": list(rows.values()),
           "cold_start_s": {"vllm-plain": [50.0]}, "greedy_identical": True}
    assert "| specdec | auto | 240 (100-260) x1.20 |" in served_peers_markdown({"config": {}, "families": [fam]})
    from specdec_bench.report import plot_served_peers

    assert [p.name for p in plot_served_peers({"families": [fam]}, tmp_path)] == ["peers_served_tiny.png"]
    cfg = yaml.safe_load(family_config("models/target", "models/draft", 8123, tmp_path).read_text())
    assert cfg["http_options"]["port"] == 8123
    assert cfg["applications"][0]["args"]["target"] == "models/target"


def test_a_pass_predicted_speedup_is_its_tokens_over_their_predicted_plain_time():
    from specdec_bench.pass_summary import predicted_speedup

    # 40 tokens predicted 2x faster than plain (20 tokens' worth of plain time) and 10 plain tokens:
    # 50 tokens in 30 tokens' plain time, not the mean of 2.0 and 1.0
    results = [{"tokens": 40, "predicted": 2.0}, {"tokens": 10, "predicted": 1.0}]
    assert predicted_speedup(results) == pytest.approx(50 / 30)
    assert predicted_speedup([{"tokens": 8, "predicted": 1.0}] * 3) == 1.0


def test_the_tpot_tail_says_whether_the_slowest_requests_waited_for_prefills_or_stepped_slowly():
    from specdec_bench.pass_summary import tpot_tail

    def req(tpot, decode_s, waits, accepted, proposed):  # 49 tokens: 48 after the first, 0.1 s to it
        return {"tokens": 49, "tpot": tpot, "ttft": 0.1, "latency": 0.1 + 48 * tpot, "decode_s": decode_s,
                "prefill_wait_s": waits, "accepted": accepted, "proposed": proposed, "verify_steps": 12,
                "plain_steps": 0}

    fast = [req(0.02, 0.9, 0.0, 36, 48)] * 98
    slow = [req(0.05, 1.2, 1.2, 12, 48), req(0.04, 0.96, 0.96, 12, 48)]  # half their decode in others' prefills
    tail = tpot_tail(fast + slow)
    assert tail["slowest"]["requests"] == 2 and tail["all"]["requests"] == 100
    assert tail["slowest"]["tpot_ms"] == pytest.approx(45.0)
    assert tail["slowest"]["prefill_wait_share"] == pytest.approx(0.5)
    assert tail["slowest"]["step_share"] == pytest.approx(0.5)
    assert tail["slowest"]["acceptance_rate"] == pytest.approx(0.25) and tail["slowest"]["mean_k"] == 4.0
    assert tail["all"]["prefill_wait_share"] < 0.05 and tail["all"]["acceptance_rate"] > 0.7
    assert tpot_tail([]) == {}


def test_budget_cells_keep_each_modes_acceptance_to_its_own_runs(family):
    """Rates by draft position depend on the K policy that judged them, so the budget must not plan with what
    the fixed-K runs taught (nor leave the engine's tracker changed for the next cell)."""
    from specdec_bench.budget import BudgetCell, Engines, run_cell

    engines = Engines(family, 4)
    engine = engines.get("draft")
    fresh, observe = engine.adaptive.tracker, engine.adaptive.observe
    seen: dict[bool, set[int]] = {True: set(), False: set()}  # budgeted run? -> trackers it taught

    def spy(cls, proposed, accepted):
        seen[engine.adaptive.budgeted].add(id(engine.adaptive.tracker))
        observe(cls, proposed, accepted)

    engine.adaptive.observe = spy
    run_cell(engines, BudgetCell("prose b2", "draft", 2, (("prose", 0.0),), 8), 1, family)
    assert seen[True] and seen[False] and not seen[True] & seen[False]
    assert engine.adaptive.tracker is fresh and fresh.evidence(engine.adaptive.traffic_class(0.0, "prose")) == 0


def test_an_interleaved_round_holds_four_requests_per_client_unless_told():
    """`serve --interleave`: a round of one request per client drains to its slowest request (a burst); by
    default each client sends four, and ``--round-requests`` sets the round (never beyond the pass)."""
    from argparse import Namespace

    from specdec_bench.load import round_size

    assert round_size(Namespace(requests=384, concurrency=16, round_requests=None)) == 64
    assert round_size(Namespace(requests=384, concurrency=16, round_requests=16)) == 16
    assert round_size(Namespace(requests=8, concurrency=4)) == 8


def test_a_closed_loop_counts_as_steady_only_the_requests_that_finished_at_full_load(monkeypatch):
    """Two clients, one of them slow: once the fast one finds the queue empty, the slow one's request runs
    alone (the drain). Steady tok/s is the concurrency x tokens / latency of the requests before that, not
    the wall's, which the drain stretches."""
    import asyncio
    from argparse import Namespace

    from specdec_bench import load
    from specdec_bench.pass_summary import steady_throughput

    durations = {0: 0.30, 1: 0.05, 2: 0.05, 3: 0.05, 4: 0.05, 5: 0.05}  # request 0 outlasts the queue

    async def fake_request(client, model, traffic, i, args, speculation):
        await asyncio.sleep(durations[i])
        return {"tokens": 10, "latency": durations[i]}

    monkeypatch.setattr(load, "traffic_request", fake_request)
    args = Namespace(concurrency=2)
    results = asyncio.run(load.closed_loop(None, "m", None, range(6), args, None))
    full = sorted(r["latency"] for r in results if r["full_load"])
    assert full == [0.05] * 5  # the fast client's five; the slow request ended in the drain
    assert steady_throughput(results, 2) == pytest.approx(2 * 50 / 0.25)
    # every request in the drain (a load of one request per client): all of them count
    assert steady_throughput([{"tokens": 10, "latency": 0.5, "full_load": False}] * 2, 2) == pytest.approx(40)
    assert steady_throughput(results, None) is None  # an open loop has no concurrency to hold


def test_passes_are_compared_with_the_best_explicit_mode_by_wall_and_by_steady_throughput():
    from specdec_bench.pass_summary import compare_passes

    passes = [{"mode": "auto", "output_throughput": 103.0, "steady_output_throughput": 110.0, "p99_tpot_ms": 130.0},
              {"mode": "plain", "output_throughput": 100.0, "steady_output_throughput": 100.0, "p99_tpot_ms": 95.0},
              {"mode": "colocated", "output_throughput": 98.0, "steady_output_throughput": 105.0,
               "p99_tpot_ms": 140.0}]
    compare_passes(passes)
    auto = passes[0]
    assert auto["best_explicit"] == "plain" and auto["vs_best_explicit"] == pytest.approx(1.03)
    assert auto["p99_tpot_vs_best"] == pytest.approx(130 / 95)
    assert auto["best_explicit_steady"] == "colocated" and auto["vs_best_explicit_steady"] == pytest.approx(110 / 105)
    assert auto["p99_tpot_vs_best_steady"] == pytest.approx(130 / 140)
    assert auto["vs_plain"] == pytest.approx(1.03)

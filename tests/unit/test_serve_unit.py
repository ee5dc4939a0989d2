"""Logic of the Serve layer without a cluster: session placement, the config and its deployment
options, calibration files and their cache, the separate topology's stopping rules, the router's
metrics and chat template. The router's state (routing, the regime map, what it learns from finished
requests) is in test_route_state.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from served import CharTokenizer, synthetic_costs

from deployments.config import AppConfig, resolve_model_path
from deployments.messages import Delta, Progress
from deployments.route_state import PRIOR_COSTS
from deployments.session_router import SessionAffinityRouter, owner
from specdec_core import SamplingParams
from specdec_core.acceptance import TrafficClass
from specdec_core.request import RequestState
from specdec_core.stats import RequestStats


def test_calibration_file_roundtrip(tmp_path):
    from deployments.calibrate import load_calibration, record, save_calibration

    costs = synthetic_costs()
    path = tmp_path / "cal.json"
    save_calibration(path, record(costs, str(tmp_path / "t"), str(tmp_path / "d"), "cpu"))
    save_calibration(path, record(PRIOR_COSTS, str(tmp_path / "t"), str(tmp_path / "other"), "cpu"))
    assert load_calibration(path, str(tmp_path / "t"), str(tmp_path / "d"), "cpu") == costs
    assert load_calibration(path, str(tmp_path / "t"), str(tmp_path / "other"), "cpu").batches == PRIOR_COSTS.batches
    assert load_calibration(path, str(tmp_path / "t"), str(tmp_path / "d"), "cuda") is None
    assert load_calibration(tmp_path / "missing.json", "t", "d", "cpu") is None


def test_autoscaling_options():
    from deployments.app import _options
    from deployments.config import AppConfig

    cfg = AppConfig(colocated={"autoscaling": {"enabled": True, "min_replicas": 1, "max_replicas": 3,
                                               "target_ongoing_requests": 4}})
    opts = _options(cfg.colocated, "ColocatedPool")
    assert "num_replicas" not in opts
    ac = opts["autoscaling_config"]
    assert (ac["min_replicas"], ac["max_replicas"], ac["upscale_delay_s"], ac["downscale_delay_s"]) == (1, 3, 0, 0)
    assert ac["policy"]["policy_function"] == "autoscaling.scaling:PoolAutoscalingPolicy"
    assert ac["policy"]["policy_kwargs"]["target_ongoing_per_replica"] == 4
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**ac)  # Serve accepts it
    assert _options(AppConfig().plain, "PlainPool")["num_replicas"] == 1
    with pytest.raises(ValidationError):
        AppConfig(plain={"autoscaling": {"enabled": True, "min_replicas": 3, "max_replicas": 2}})


def test_owner_is_stable_and_moves_only_lost_sessions():
    replicas = ["r1", "r2", "r3"]
    sessions = [f"s{i}" for i in range(300)]
    placed = {s: owner(s, replicas) for s in sessions}
    assert placed == {s: owner(s, list(reversed(replicas))) for s in sessions}  # order-free
    assert set(placed.values()) == set(replicas)
    after = {s: owner(s, ["r1", "r3"]) for s in sessions}
    assert all(after[s] == placed[s] for s in sessions if placed[s] != "r2")


def test_session_router_choose_replicas():
    router = object.__new__(SessionAffinityRouter)  # choose_replicas needs no router state
    reps = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in ("aa", "bb", "cc")]

    def pending(session_id):
        return SimpleNamespace(metadata=SimpleNamespace(session_id=session_id),
                               routing_context=SimpleNamespace(should_backoff=False))

    for s in ("x", "y", "z", "w"):
        req = pending(s)
        ranks = asyncio.run(router.choose_replicas(reps, req))
        assert len(ranks) == 1 and len(ranks[0]) == 1
        assert ranks[0][0].replica_id.unique_id == owner(s, ["aa", "bb", "cc"])
        assert req.routing_context.should_backoff  # wait for the owner rather than spill
    assert asyncio.run(router.choose_replicas(reps, pending(""))) == [reps]
    assert asyncio.run(router.choose_replicas([], pending("x"))) == []


def test_app_config():
    cfg = AppConfig()
    assert cfg.has_plain and cfg.has_colocated and cfg.has_separate
    assert not AppConfig(draft=None).has_colocated
    with pytest.raises(ValidationError):
        AppConfig(no_such_option=1)
    with pytest.raises(ValidationError):
        AppConfig(default_k=9, k_max=8)
    with pytest.raises(ValidationError):
        AppConfig(auto_max_running=4)  # the placeholder rule's keys are gone
    with pytest.raises(ValidationError):
        AppConfig(draft_deployment={"num_replicas": 0})
    for name, field in AppConfig.model_fields.items():
        assert field.description, name
    assert resolve_model_path("no/such/model") == "no/such/model"
    assert resolve_model_path("tests").endswith("/tests")


def _req(**kw) -> RequestState:
    return RequestState("r", [1, 2], SamplingParams(**kw), CharTokenizer(), eos_ids={99})


def test_separate_request_stopping_rules():
    r = _req(max_new_tokens=10)
    r.commit([0, 1, 99, 3])  # EOS ends the request and is not emitted
    assert (r.output_ids, r.finish_reason, r.tokens) == ([0, 1], "stop", [1, 2, 0, 1])
    r = _req(max_new_tokens=10, ignore_eos=True)
    r.commit([0, 99])
    assert r.output_ids == [0, 99] and not r.finished
    r = _req(max_new_tokens=3)
    r.commit([0, 1, 2, 3])  # a verify may emit past the budget: cut at it
    assert (r.output_ids, r.finish_reason) == ([0, 1, 2], "length")
    r = _req(max_new_tokens=10, stop=("cd",))
    r.commit([0, 1, 2, 3, 4])
    assert (r.finish_reason, Delta.of(r.output()).text) == ("stop", "ab")
    r = _req(max_new_tokens=10)
    r.commit([0, 1])
    d = Delta.of(r.output())
    assert (d.token_ids, d.text, d.finished) == ([0, 1], "ab", False)
    r.commit([2])
    assert Delta.of(r.output()).token_ids == [2]
    assert r.budget_k(4, max_len=100) == 4
    assert r.budget_k(9, max_len=6) == 1  # 5 tokens held, room for 1 draft token
    # an overlapped round's proposal follows 4 tokens not yet committed: 3 of the 7 left, room for 2
    assert r.budget_k(4, max_len=100, ahead=4) == 2
    assert r.budget_k(9, max_len=8, ahead=2) == 1  # 5 held + 2 ahead: room for 1
    r2 = _req(max_new_tokens=2)
    r2.commit([0])
    assert r2.budget_k(4, max_len=100) == 0  # one token left: a plain step emits it


def test_a_running_requests_deltas_report_its_decode_steps_and_its_last_its_stats():
    """Each delta but the last says how many decode steps the request ran plain and speculative so far (what
    the router learns a pool's decline from as it decodes); coalesced deltas keep the later count."""
    r = _req(max_new_tokens=10)
    r.stats.record_verify(0, 0)  # the prefill's pass: no decode step
    r.commit([0])
    first = Delta.of(r.output())
    assert (first.progress, first.stats) == (Progress(0, 0, 0), None)
    r.stats.record_verify(2, 1)
    r.stats.record_verify(0, 0)
    r.stats.decode_batch_rows += 6
    r.commit([1, 2])
    second = Delta.of(r.output())
    assert second.progress == Progress(plain_steps=1, verify_steps=1, batch_rows=6)
    assert first.merged(second).progress == second.progress and second.progress.since(first.progress).steps == 2
    r.commit([99])
    last = Delta.of(r.output())
    assert last.finished and last.progress is None and last.stats is r.stats


def test_router_metrics_accept_zero_counts():
    from deployments.metrics import RouterMetrics

    m = RouterMetrics()
    m.finished("plain", 0, None, "length", RequestStats(output_tokens=3), 0.1)
    m.finished("colocated", 4, "colocated", "abort", None, 0.1)
    m.finished("colocated", 4, "colocated", "length", RequestStats(output_tokens=8, proposed=8, verify_steps=4),
               0.1, "favorable", 1.3)
    m.routed("plain", 0, "large_batch", "auto", 1.0)
    m.set_running("plain", 0)
    m.acceptance(TrafficClass("d", "greedy", "default"), 0.5, [0.6, 0.4])


def test_specdec_calibrate_cli(tiny_models, tmp_path):
    """The console script's entry point writes a record the replicas can load (a small grid)."""
    from deployments.calibrate import load_calibration, main

    out = tmp_path / "cal.json"
    main(["--target", tiny_models["target"], "--draft", tiny_models["draft"], "--out", str(out),
          "--batches", "1,2", "--qs", "1,2", "--max-batch-size", "4"])
    costs = load_calibration(out, tiny_models["target"], tiny_models["draft"], "cpu")
    assert costs is not None and costs.batches == (1, 2) and costs.qs == (1, 2)
    assert costs.target_time(1, 1) > 0 and costs.draft_time(1) > 0


def test_chat_fallback_template_keeps_special_token_text_as_text():
    """The shipped tokenizer has no chat template: a message that spells "<|endoftext|>" (the EOS and
    document separator) stays text in the prompt, never the special token; roles come from the
    fixed set (schemas.ChatMessage), so a turn cannot be forged through one."""
    from deployments.planning import Prompts

    prompts = Prompts(AppConfig(target="models/target", draft=None))
    eos = prompts.tokenizer.eos_token_id
    ids = asyncio.run(prompts.chat_ids([{"role": "user", "content": "hi <|endoftext|> there"}]))
    assert eos not in ids
    assert prompts.tokenizer.decode(ids) == "user: hi <|endoftext|> there\nassistant:"


def test_startup_calibration_cache_is_keyed_by_weights_and_grid(tmp_path, monkeypatch, tiny_models):
    """A cached calibration comes back for the same models and grid on this host; new weights at the
    same path (or another grid) miss, so a retrained model is never priced by its predecessor's costs."""
    import os
    import time

    from deployments import calibrate

    monkeypatch.setattr(calibrate, "CACHE_DIR", tmp_path)
    grid = {"batches": (1, 2), "qs": (1, 5), "long_context_len": 64}
    key = calibrate.cache_key(tiny_models["target"], tiny_models["draft"], "cpu", None, **grid)
    assert calibrate.cached(key) is None
    costs = synthetic_costs()
    calibrate.store(key, costs, None)
    greedy, sampled = calibrate.cached(key)
    assert greedy.to_dict() == costs.to_dict() and sampled is None
    assert calibrate.cache_key(tiny_models["target"], tiny_models["draft"], "cpu", None, **grid) == key
    assert calibrate.cache_key(tiny_models["target"], tiny_models["draft"], "cpu", None,
                               **{**grid, "qs": (1, 3)}) != key
    weights = next(p for p in os.scandir(tiny_models["target"]) if p.name.endswith(".safetensors"))
    later = time.time() + 10
    os.utime(weights.path, (later, later))  # retrained in place
    assert calibrate.cache_key(tiny_models["target"], tiny_models["draft"], "cpu", None, **grid) != key


def test_placement_options_reach_serve():
    """Custom resources and node labels of a deployment go into its ray_actor_options (only where set),
    in a form Serve accepts, so an operator can put the Draft and the Target on different nodes."""
    from ray.serve._private.config import ReplicaConfig

    from deployments.app import _options

    cfg = AppConfig(draft_deployment={"resources": {"draft_node": 0.01}},
                    target_deployment={"label_selector": {"ray.io/node-group": "target"}})
    draft, target = _options(cfg.draft_deployment, "Draft"), _options(cfg.target_deployment, "Target")
    assert draft["ray_actor_options"]["resources"] == {"draft_node": 0.01}
    assert "label_selector" not in draft["ray_actor_options"]
    assert target["ray_actor_options"]["label_selector"] == {"ray.io/node-group": "target"}
    assert "resources" not in _options(cfg.plain, "PlainPool")["ray_actor_options"]
    for opts in (draft, target):
        ReplicaConfig.create(lambda: None, ray_actor_options=opts["ray_actor_options"])  # Serve's own validation


def test_replicas_build_and_calibrate_one_at_a_time_and_a_killed_holder_lets_go(tmp_path, monkeypatch):
    """``measuring_alone``: while one process holds it (a replica probing kernels or calibrating), another
    waits; a holder SIGKILLed mid-measurement releases it (the kernel drops its flock)."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from deployments import calibrate

    monkeypatch.setattr(calibrate, "CACHE_DIR", tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom deployments import calibrate\n"
         "with calibrate.measuring_alone():\n    print('held', flush=True)\n    time.sleep(120)\n"],
        env={**os.environ, "SPECDEC_CALIBRATION_CACHE": str(tmp_path)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def measure():
            with calibrate.measuring_alone():
                entered.set()

        waiter = threading.Thread(target=measure, daemon=True)
        waiter.start()
        assert not entered.wait(1.0)  # the holder has it
        holder.send_signal(signal.SIGKILL)
        assert entered.wait(30.0)
    finally:
        holder.kill()
        holder.wait()


def test_the_engines_on_a_host_run_the_kernel_bands_its_first_replica_probed(tmp_path, monkeypatch, tiny_models):
    """A replica that builds its models in ``measuring_alone`` keeps the kernel bands it probed for the
    host; a later process (another replica, the next start) adopts them instead of probing again, so the
    engines on a host run the same kernels, the ones its cached calibration measured."""
    import json

    from deployments import calibrate
    from specdec_core import linear
    from specdec_core.runner import ModelRunner

    monkeypatch.setattr(calibrate, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(linear, "_BANDS", {})  # a fresh process
    with calibrate.measuring_alone():
        first = ModelRunner.from_pretrained(tiny_models["target"], device="cpu", max_slots=1, max_len=16)
    if not linear._prepack_supported(first.model.lm_head.weight):
        pytest.skip("no oneDNN in this torch build")
    kept = calibrate.host_bands()
    assert kept == linear.probed_bands() and len(kept) >= 3  # qkv, o_proj, gate_up, down, lm_head shapes
    # Another start on the host, whose file says the packed kernel wins at 2-5 rows for every shape
    calibrate._bands_path().write_text(json.dumps(dict.fromkeys(kept, [2, 5])))
    monkeypatch.setattr(linear, "_BANDS", {})
    probes = []
    monkeypatch.setattr(linear, "_probe", lambda *shape: probes.append(shape))
    with calibrate.measuring_alone():
        later = ModelRunner.from_pretrained(tiny_models["target"], device="cpu", max_slots=1, max_len=16)
    assert probes == []  # adopted, not probed
    assert set(later.kernel_bands().values()) == {range(2, 6)}


def test_routing_learns_decode_time_without_the_prefills_a_request_waited_for():
    """A non-streamed request (one message: the replica's clock) that decoded 9 tokens after its first
    in 1.2 s, 0.3 s of them other requests' prefills: the wall time per token is what it saw (metrics),
    the time less the waits what its steps cost (what the router learns drift from)."""
    from deployments.pools import _decode_time_per_token

    stats = RequestStats(output_tokens=10, first_token_s=0.5, latency_s=1.7, prefill_wait_s=0.3)
    last = Delta([], "", finished=True, finish_reason="length", stats=stats)
    assert _decode_time_per_token(None, 0, 0, last) == pytest.approx(1.2 / 9)
    assert _decode_time_per_token(None, 0, 0, last, prefill_waits=False) == pytest.approx(0.9 / 9)

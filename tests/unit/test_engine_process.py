"""The engine in a process of its own (deployments/engine_process.py), driven as a replica drives it:
concurrent streams see only their own tokens, an early exit frees the request's slots in the engine,
refused input is a ValueError, and a dead engine fails what was in flight and says so once."""

import asyncio
import os
import signal

import pytest

from deployments.config import AppConfig
from deployments.engine_process import EngineDied, EngineProcess
from deployments.messages import GenerateRequest
from specdec_core import Engine, SamplingParams

PROMPTS = ["It is a truth", "def fibonacci(n):", "In the beginning", "for i in range(10):"]


def _config(models: dict, **kw) -> AppConfig:
    return AppConfig(**{"target": models["target"], "draft": models["draft"], "max_model_len": 256,
                        "calibrate_on_start": False, **kw})


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module, as a replica has one for its life (the pipe is bound to it)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine_process(tiny_models, loop):
    proc = EngineProcess(_config(tiny_models), speculative=True, pool="colocated")
    yield proc
    proc.shutdown()
    loop.run_until_complete(asyncio.sleep(0.1))  # the pipe's reader sees it close


def _request(engine: Engine, rid: str, prompt: str, k: int, max_new_tokens: int = 16) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=max_new_tokens, num_speculative_tokens=k)
    return GenerateRequest(rid, engine.encode(prompt), params)


async def _collect(proc: EngineProcess, req: GenerateRequest) -> list[int]:
    ids = []
    async for delta in proc.stream(req):
        ids += delta.token_ids
    return ids


def test_concurrent_streams_match_solo_results(engine_process, tiny_models, loop):
    local = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_model_len=256)
    solo = [local.generate([p], max_new_tokens=16, num_speculative_tokens=3)[0].token_ids for p in PROMPTS]

    async def main():
        return await asyncio.gather(*[_collect(engine_process, _request(local, f"{i}-{k}", p, k))
                                      for i, p in enumerate(PROMPTS) for k in (0, 3)])

    assert loop.run_until_complete(main()) == [s for s in solo for _ in (0, 3)]


def test_leaving_a_stream_early_frees_its_slots(engine_process, tiny_models, loop):
    local = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_model_len=256)

    async def main():
        stream = engine_process.stream(_request(local, "long", "It is a truth", 3, max_new_tokens=200))
        first = await stream.__anext__()
        await stream.aclose()
        # The engine applies what arrived, then steps: the abort is processed by the step after the first
        # answer, so the second sees it (without the abort the request would run ~190 more steps).
        for _ in range(3):
            fields = await engine_process.fields()
            if fields["running"] == 0:
                break
        return first, fields

    first, fields = loop.run_until_complete(main())
    assert first.token_ids and not first.finished
    assert fields["free_slots"] == fields["total_slots"] and fields["draft_sessions"] == 0, fields
    assert engine_process.load() == (0, 0)


def test_refused_input_is_a_value_error(engine_process, loop):
    req = GenerateRequest("bad", [1, 2, 3], SamplingParams(max_new_tokens=10_000))

    with pytest.raises(ValueError, match="context limit"):
        loop.run_until_complete(_collect(engine_process, req))


def test_an_engine_that_fails_to_start_says_why(tiny_models, tmp_path):
    with pytest.raises(RuntimeError, match="failed to start"):
        EngineProcess(_config(tiny_models, draft=str(tmp_path / "missing")), speculative=True, pool="colocated")


def test_a_dead_engine_fails_the_streams_in_flight_and_reports_once(tiny_models):
    deaths = []
    proc = EngineProcess(_config(tiny_models), speculative=False, pool="plain", on_death=lambda: deaths.append(1))
    local = Engine.from_pretrained(tiny_models["target"], None, max_model_len=256)

    async def main():
        stream = proc.stream(_request(local, "doomed", "It is a truth", 0, max_new_tokens=200))
        await stream.__anext__()
        os.kill(proc._proc.pid, signal.SIGKILL)
        async for _ in stream:
            pass

    try:
        with pytest.raises(EngineDied):
            asyncio.run(main())
        assert deaths == [1] and not proc.alive()
    finally:
        proc.shutdown()

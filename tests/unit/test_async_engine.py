"""The asyncio front: concurrent streams see only their own tokens, cancellation frees slots."""

import asyncio

import pytest

from specdec_core import AsyncEngine, Engine, SamplingParams

PROMPTS = ["It is a truth", "def fibonacci(n):", "In the beginning", "for i in range(10):"]


@pytest.fixture(scope="module")
def async_engine(tiny_models):
    eng = AsyncEngine(Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_model_len=256))
    yield eng
    eng.shutdown()


def test_concurrent_streams_match_solo_results(async_engine):
    solo = [async_engine.engine.generate([p], max_new_tokens=16, num_speculative_tokens=3)[0].token_ids
            for p in PROMPTS]

    async def collect(prompt, k):
        ids = []
        async for out in async_engine.stream(prompt, SamplingParams(max_new_tokens=16, num_speculative_tokens=k)):
            ids += out.new_token_ids
        return ids

    async def main():
        return await asyncio.gather(*[collect(p, k) for p in PROMPTS for k in (0, 3)])

    results = asyncio.run(main())
    assert results == [s for s in solo for _ in (0, 3)]


def test_cancelled_stream_frees_slots(async_engine):
    async def main():
        agen = async_engine.stream("It is a truth", SamplingParams(max_new_tokens=200, num_speculative_tokens=3))
        await agen.__anext__()
        await agen.aclose()
        for _ in range(100):
            if not async_engine.engine.has_work():
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    eng = async_engine.engine
    assert eng.target.num_free_slots == eng.target.num_slots
    assert eng.proposer.num_sequences() == 0


def test_bad_request_raises_before_streaming(async_engine):
    async def main():
        async for _ in async_engine.stream("x", SamplingParams(max_new_tokens=0)):
            pass

    with pytest.raises(ValueError, match="max_new_tokens"):
        asyncio.run(main())

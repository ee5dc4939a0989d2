"""The separate topology's context changes (deployments/contexts.py) and its direct channel
(deployments/channel.py): a replica rebuilds exactly the context the loop meant from the changes
it receives, and a channel carries concurrent calls, failures and a replica's death."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import time
from typing import Any

import pytest

from deployments.channel import Channel, ChannelCallError, ChannelClosed, ChannelServer
from deployments.contexts import ReplicaContexts, SentContexts
from specdec_core import SamplingParams

P = SamplingParams(max_new_tokens=64)


def test_replica_rebuilds_every_context_from_changes():
    """A request's history grows by what verify steps emit; the draft's context also ends in
    proposals, which the next change cuts. Every message is a change after the first, and the
    replica's copy equals what the loop meant each time."""
    rng = random.Random(0)
    sent, replica = SentContexts(), ReplicaContexts()
    history = [rng.randrange(100) for _ in range(20)]
    sizes = []
    for step in range(200):
        proposal = [rng.randrange(100) for _ in range(rng.randrange(0, 5))]
        context = history + proposal if step % 2 else list(history)
        msg = sent.change("s", context, len(history), P)
        assert (msg.start == 0) == (step == 0) and (msg.params is not None) == (step == 0)
        assert replica.apply(msg) == (context, P)
        sizes.append(len(msg.tokens))
        accepted = rng.randrange(len(proposal) + 1)
        history = history + proposal[:accepted] + [rng.randrange(100)]
    assert max(sizes[1:]) <= 10  # changes, not histories (which reach ~400 tokens)


def test_proposal_tokens_equal_to_later_history_are_not_resent():
    sent, replica = SentContexts(), ReplicaContexts()
    replica.apply(sent.change("s", [1, 2, 3], 3, P))
    replica.apply(sent.change("s", [1, 2, 3, 4, 5], 3, P))  # optimistic context: history + proposal
    msg = sent.change("s", [1, 2, 3, 4, 9], 4, P)  # 4 accepted, 9 recovered
    assert (msg.start, msg.tokens) == (4, [9])
    assert replica.apply(msg) == ([1, 2, 3, 4, 9], P)


def test_a_replica_without_the_session_asks_for_a_resync():
    sent = SentContexts()
    ReplicaContexts().apply(sent.change("s", [1, 2, 3], 3, P))
    restarted = ReplicaContexts()  # the replica died and came back: it holds nothing
    msg = sent.change("s", [1, 2, 3, 4], 4, P)
    assert restarted.apply(msg) is None
    sent.forget("s")
    whole = sent.change("s", [1, 2, 3, 4], 4, P)
    assert (whole.start, whole.tokens, whole.params) == (0, [1, 2, 3, 4], P)
    assert restarted.apply(whole) == ([1, 2, 3, 4], P)
    restarted.drop("s")
    assert restarted.apply(sent.change("s", [1, 2, 3, 4, 5], 5, P)) is None


def _run(coro):
    return asyncio.run(coro)


def _methods(handlers) -> dict:
    return {m: (Any, Any) for m in handlers}  # argument and result decode into plain msgpack values


def _server(handlers, on_close=lambda peer: None) -> ChannelServer:
    return ChannelServer("replica-1", _methods(handlers), handlers, max_frame_bytes=1 << 20,
                         handshake_timeout_s=5.0, on_close=on_close)


async def _serve(handlers):
    server = _server(handlers)
    return server, await server.address("127.0.0.1")


def test_channel_answers_concurrent_calls_out_of_order():
    async def main():
        async def slow_echo(x, _peer):
            await asyncio.sleep(x)
            return x

        _, addr = await _serve({"echo": slow_echo})
        ch = await Channel.open(addr, _methods({"echo": None}))
        got = await asyncio.gather(*(ch.call("echo", d, 5.0) for d in (0.3, 0.0, 0.1)))
        assert got == [0.3, 0.0, 0.1]
        ch.close()

    _run(main())


def test_channel_reports_a_failed_call_and_stays_open():
    async def main():
        async def boom(_, _peer):
            raise ValueError("bad item")

        async def ok(x, _peer):
            return x + 1

        _, addr = await _serve({"boom": boom, "ok": ok})
        ch = await Channel.open(addr, _methods({"boom": None, "ok": None}))
        with pytest.raises(ChannelCallError, match="ValueError: bad item"):
            await ch.call("boom", None, 5.0)
        assert await ch.call("ok", 1, 5.0) == 2

    _run(main())


def _replica_process(conn) -> None:
    """A replica process: a channel whose one method never answers."""

    async def main():
        async def hang(_, _peer):
            await asyncio.Event().wait()

        conn.send(await _server({"hang": hang}).address("127.0.0.1"))
        await asyncio.Event().wait()

    asyncio.run(main())


def test_a_dead_replica_fails_calls_in_flight_at_once():
    """The replica's process is killed mid-call: the call fails with ChannelClosed at once, not
    after its timeout, and later calls fail without waiting."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_replica_process, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(60)
        addr = parent.recv()

        async def main():
            ch = await Channel.open(addr, _methods({"hang": None}))
            call = asyncio.ensure_future(ch.call("hang", None, 60.0))
            await asyncio.sleep(0.3)
            assert not call.done()
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(ChannelClosed):
                await call
            assert time.monotonic() - t0 < 10.0  # the 60 s timeout was not what ended it
            with pytest.raises(ChannelClosed):
                await ch.call("hang", None, 60.0)

        _run(main())
    finally:
        proc.kill()
        proc.join()


def test_the_replica_hears_when_a_connection_closes():
    """A loop's owner that goes away (closes, or dies with, its connection) is reported to the
    replica by its connection's number, the one its calls came with."""

    async def main():
        seen, closed = [], asyncio.Event()

        async def hello(_, peer):
            seen.append(peer)

        def on_close(peer):
            seen.append(("closed", peer))
            closed.set()

        addr = await _server({"hello": hello}, on_close).address("127.0.0.1")
        ch = await Channel.open(addr, _methods({"hello": None}))
        await ch.call("hello", None, 5.0)
        ch.close()
        await asyncio.wait_for(closed.wait(), 5.0)
        assert seen == [seen[0], ("closed", seen[0])]

    _run(main())


def test_a_call_not_answered_in_time_closes_the_channel():
    async def main():
        async def hang(_, _peer):
            await asyncio.sleep(30)

        _, addr = await _serve({"hang": hang})
        ch = await Channel.open(addr, _methods({"hang": None}))
        with pytest.raises(ChannelClosed, match="did not answer"):
            await ch.call("hang", None, 0.2)
        assert ch.closed

    _run(main())


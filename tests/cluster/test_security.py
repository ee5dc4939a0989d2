"""No one gets in: a Draft/Target channel authenticates before it decodes a byte, decodes only its
declared message types, bounds its frames; Ray's token authentication stays on.

The channel tests run the real ``ChannelServer`` and ``Channel`` over real sockets on 127.0.0.1
(the Serve replica around them adds nothing to what is checked here); the served test runs them in
the replicas of a real app.
"""

import asyncio
import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from deployments.channel import TOKEN_BYTES, Channel, ChannelCallError, ChannelClosed, ChannelServer
from deployments.config import AppConfig
from deployments.messages import (
    DRAFT_METHODS,
    TARGET_METHODS,
    ItemFailed,
    ProposeStepItem,
    Resync,
    SessionContext,
    VerifyStepItem,
)
from deployments.wire import ENVELOPE, Call, Codec
from specdec_core import Proposal, SamplingParams, VerifyResult

MAX_FRAME = 1 << 16


class Exploit:
    """Unpickling this runs a shell command that creates a file: the proof that bytes got decoded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _item(sid="s1", k=2, tokens=(1, 2, 3)):
    return ProposeStepItem(SessionContext(sid, 0, list(tokens), SamplingParams(temperature=1.0, stop=("x",))), k)


class Replica:
    """A ChannelServer with the Draft's methods whose handlers record what reached them."""

    def __init__(self, handshake_timeout_s=0.5):
        self.calls = []
        self.closed_peers = []
        self.server = ChannelServer("replica-1", DRAFT_METHODS, {"step": self.step, "release": self.release},
                                    max_frame_bytes=MAX_FRAME, handshake_timeout_s=handshake_timeout_s,
                                    on_close=self.closed_peers.append)

    async def step(self, items, peer):
        self.calls.append(("step", items))
        return [Proposal(it.context.tokens[-1:] * it.k, torch.full((it.k, 3), 0.25)) for it in items]

    async def release(self, ids, peer):
        self.calls.append(("release", ids))
        if ids == ["boom"]:
            raise KeyError("boom")
        return len(ids)


async def _raw(address, payload: bytes, wait_s=2.0) -> bytes | None:
    """Send ``payload`` on a fresh connection: what the replica sent back once it closed it, or None
    if it kept it open for ``wait_s`` (the connection is then closed from this end)."""
    reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(payload)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), wait_s)  # b"" once the replica closed it
    except asyncio.TimeoutError:
        return None
    finally:
        writer.close()


def _frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


def _call(method: str, argument: bytes) -> bytes:
    return _frame(ENVELOPE.encode(Call(0, method, msgspec.Raw(argument))))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_right_token_serves_typed_calls_and_failures_stay_per_call():
    async def go():
        replica = Replica()
        address = await replica.server.address("127.0.0.1")
        ch = await Channel.open(address, DRAFT_METHODS)
        items = [_item("a"), _item("b", k=3, tokens=(7, 8))]
        proposals, released = await asyncio.gather(ch.call("step", items, 5), ch.call("release", ["a"], 5))
        with pytest.raises(ChannelCallError, match="KeyError"):
            await ch.call("release", ["boom"], 5)
        assert await ch.call("release", ["b"], 5) == 1  # the channel lives on after a failed call
        ch.close()
        return replica, proposals, released

    replica, proposals, released = run(go())
    got = replica.calls[0][1]
    assert got == [_item("a"), _item("b", k=3, tokens=(7, 8))]  # dataclasses rebuilt field by field
    assert [p.token_ids for p in proposals] == [[3, 3], [8, 8, 8]]
    assert proposals[1].probs.shape == (3, 3) and torch.equal(proposals[1].probs, torch.full((3, 3), 0.25))
    assert released == 1 and replica.server.refused == 0


@pytest.mark.parametrize("first_bytes", ["pickle", "wrong_token", "random", "short_then_silent"])
def test_a_connection_without_the_token_is_closed_before_anything_is_decoded(tmp_path, first_bytes):
    marker = tmp_path / "pwned"

    async def go():
        replica = Replica()
        address = await replica.server.address("127.0.0.1")
        payload = {
            # the review's attack: a pickle as the first frame, where the token should be
            "pickle": _frame(pickle.dumps(Exploit(marker))),
            "wrong_token": bytes(b ^ 1 for b in address.token) + _call("release", msgspec.msgpack.encode(["x"])),
            "random": os.urandom(4096),
            "short_then_silent": address.token[:TOKEN_BYTES - 1],  # then nothing: the handshake times out
        }[first_bytes]
        answer = await _raw(address, payload)
        # the replica still serves an authenticated peer
        ch = await Channel.open(address, DRAFT_METHODS)
        assert await ch.call("release", ["ok"], 5) == 1
        ch.close()
        return replica, answer

    replica, answer = run(go())
    assert answer == b""
    assert not marker.exists()
    assert replica.calls == [("release", ["ok"])]  # no handler ran for the refused connection
    assert replica.server.refused == 1
    assert replica.closed_peers in ([], [0])  # only the authenticated peer ever counted as one


@pytest.mark.parametrize("frame", ["pickle_after_token", "over_the_bound", "truncated", "wrong_types",
                                   "unknown_method"])
def test_an_authenticated_peer_that_breaks_the_framing_loses_its_connection_only(tmp_path, frame):
    marker = tmp_path / "pwned"

    async def go():
        replica = Replica()
        address = await replica.server.address("127.0.0.1")
        bystander = await Channel.open(address, DRAFT_METHODS)
        payload = address.token + {
            "pickle_after_token": _frame(pickle.dumps(Exploit(marker))),
            # announced, never sent: refused on the length alone, nothing buffered
            "over_the_bound": struct.pack("!I", (4 << 30) - 1),
            "truncated": struct.pack("!I", 100) + b"\x93\x00",
            # a well-formed call whose argument is not a list of ProposeStepItem
            "wrong_types": _call("step", msgspec.msgpack.encode([{"context": "x", "k": "y"}])),
            "unknown_method": _call("__init__", msgspec.msgpack.encode([])),
        }[frame]
        answer = await _raw(address, payload, wait_s=0.5 if frame == "truncated" else 5.0)
        await asyncio.sleep(0.1)
        still = await bystander.call("step", [_item("c")], 5)
        bystander.close()
        await asyncio.sleep(0.1)
        return replica, answer, still

    replica, answer, still = run(go())
    assert not marker.exists()
    assert [c[0] for c in replica.calls] == ["step"] and still[0].token_ids == [3, 3]
    if frame == "truncated":  # the replica waits for the rest; the peer's hang-up frees what it held
        assert answer is None and replica.server.refused == 0 and 1 in replica.closed_peers
    else:
        assert answer == b"" and replica.server.refused == 1


def test_wire_codec_round_trips_the_step_messages_and_refuses_other_types():
    ctx = SessionContext("s", 3, [4, 5], None)
    verify = Codec(TARGET_METHODS["step"][0])
    items = [VerifyStepItem(ctx, None), VerifyStepItem(ctx, Proposal([1, 2], torch.rand(2, 5, dtype=torch.bfloat16)))]
    back = verify.decode(verify.encode(items))
    assert back[0] == items[0] and torch.equal(back[1].proposal.probs, items[1].proposal.probs)
    replies = Codec(TARGET_METHODS["step"][1])
    answer = [VerifyResult([1, 2], 2, 1), Resync(), ItemFailed("no slot")]
    assert replies.decode(replies.encode(answer)) == answer
    with pytest.raises(msgspec.ValidationError):  # an item type index past the union
        replies.decode(msgspec.msgpack.encode([[7, {}]]))
    with pytest.raises(msgspec.ValidationError):  # a tensor whose bytes do not fill its shape
        Codec(DRAFT_METHODS["step"][1]).decode(msgspec.msgpack.encode([[0, {"token_ids": [1], "probs":
                                                                              ["float32", [1, 4], b"\0" * 8]}]]))
    with pytest.raises(msgspec.ValidationError):  # a dtype outside the list
        Codec(DRAFT_METHODS["step"][1]).decode(msgspec.msgpack.encode([[0, {"token_ids": [1], "probs":
                                                                              ["complex128", [1], b"\0" * 16]}]]))


def test_frame_bound_covers_the_largest_step_message():
    cfg = AppConfig()
    vocab = 4096
    largest = [Proposal([1] * cfg.k_max, torch.rand(cfg.k_max, vocab)) for _ in range(cfg.max_batch_size)]
    encoded = Codec(DRAFT_METHODS["step"][1]).encode(largest)
    contexts = Codec(DRAFT_METHODS["step"][0]).encode(
        [_item(f"session-{i}", cfg.k_max, tokens=[vocab - 1] * cfg.max_model_len) for i in range(cfg.max_batch_size)])
    bound = cfg.channel_frame_bound(vocab)
    assert max(len(encoded), len(contexts)) * 1.5 < bound < 4 * len(encoded)
    assert AppConfig(channel_max_frame_bytes=4096).channel_frame_bound(vocab) == 4096


def test_a_channel_refuses_a_reply_over_the_bound():
    """The loop owner's end holds the replica's answers to the same bound."""

    async def go():
        replica = Replica()
        address = await replica.server.address("127.0.0.1")
        small = type(address)(address.replica, address.host, address.port, address.token, 64)
        ch = await Channel.open(small, DRAFT_METHODS)
        with pytest.raises(ChannelClosed):
            await ch.call("step", [_item("big", k=8)], 5)

    run(go())


def test_ray_dashboard_refuses_job_submission_without_the_token():
    """A cluster started the README's way (``./run`` exports ``RAY_AUTH_MODE=token``) keeps Ray's token
    authentication: its Jobs API (code execution for whoever reaches it) answers 401 to a request
    without the token or with a wrong one, and takes one with the token ``deployments.ray_auth`` finds."""
    script = r"""
import json, time, urllib.error, urllib.request
import ray
from deployments.ray_auth import auth_headers
url = "http://" + ray.init(num_cpus=1, include_dashboard=True, log_to_driver=False).dashboard_url
body = json.dumps({"entrypoint": "echo ok"}).encode()
def submit(headers):
    req = urllib.request.Request(url + "/api/jobs/", body, {"content-type": "application/json", **headers})
    try:
        return urllib.request.urlopen(req, timeout=20).status
    except urllib.error.HTTPError as e:
        return e.code
for _ in range(60):  # the dashboard's HTTP server may come up a moment after ray.init returns
    try:
        urllib.request.urlopen(url + "/api/version", timeout=5)
    except urllib.error.HTTPError:
        break
    except OSError:
        time.sleep(0.5)
print(json.dumps({"without": submit({}), "wrong": submit({"authorization": "Bearer nope"}),
                  "with": submit(auth_headers())}))
ray.shutdown()
"""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240,
                         check=False, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    codes = json.loads(out.stdout.strip().splitlines()[-1])
    assert codes["without"] == 401 and codes["wrong"] in (401, 403)
    assert codes["with"] == 200  # the token the README's commands use is the one Ray checks

"""Direct channels: the separate topology's step loop talks to Draft and Target replicas over one
TCP connection per replica instead of a Serve handle call per step.

Why: a Serve handle call costs 1.3-2.5 ms of routing, gRPC and replica queueing per hop on this
machine, and a step takes two (docs/ARCHITECTURE.md, "Facts"); a frame over an open connection
costs an encode and a socket write. The replicas stay Serve deployments (resources, replicas,
health checks, restarts, the dashboard): a session-pinned handle call finds the replica and returns
its ``ChannelAddress``, after which the steps go direct. A replica that dies closes its connection,
so every call in flight fails at once with ``ChannelClosed`` (a Serve call to a dead replica is held
until its replacement is up, ~15 s here).

Who may talk: the replica draws a random token that only the session-pinned handle call (over
Ray, which authenticates its callers) reveals. A connection's first bytes must be exactly that
token, compared in constant time and within ``handshake_timeout_s``; until then nothing is decoded
and no handler runs, and a connection that fails it is closed.

Frames: a 4-byte big-endian length (at most ``max_frame_bytes``, checked before anything is read
into memory), then msgpack (``deployments/wire.py``): ``Call(call_id, method, argument)`` one way,
``Reply(call_id, ok, result_or_message)`` the other, each argument and result decoded only into the
type its method declares (``ChannelMethods``). Calls are answered in any order. A frame that is too
large, does not decode, or names an unknown method closes that connection only.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from deployments.wire import CALL, ENVELOPE, MESSAGE, REPLY, Call, Codec, Reply

logger = logging.getLogger("ray.serve")

FRAME_LENGTH = struct.Struct("!I")
TOKEN_BYTES = 32
ChannelMethods = dict[str, tuple[Any, Any]]  # method -> (argument type, result type)


class FrameError(ConnectionError):
    """The peer broke the framing (a frame over the bound, or bytes that do not decode): the
    connection is closed."""


class ChannelClosed(ConnectionError):
    """The replica's end of the channel is gone (it died or restarted), or it never answered."""


class ChannelCallError(RuntimeError):
    """The replica ran the call and it failed there (the message says why)."""


@dataclass(frozen=True)
class ChannelAddress:
    replica: str  # the Serve replica's unique id
    host: str
    port: int
    token: bytes  # TOKEN_BYTES random bytes
    max_frame_bytes: int  # the bound both ends hold frames to


class _Codecs:
    """Each method's argument and result codec."""

    def __init__(self, methods: ChannelMethods):
        self.arguments = {m: Codec(arg) for m, (arg, _) in methods.items()}
        self.results = {m: Codec(res) for m, (_, res) in methods.items()}


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    (length,) = FRAME_LENGTH.unpack(await reader.readexactly(FRAME_LENGTH.size))
    if length > max_bytes:  # refused before a byte of it is buffered
        raise FrameError(f"frame of {length} bytes over the bound of {max_bytes}")
    return await reader.readexactly(length)


def frame(payload: bytes) -> bytes:
    return FRAME_LENGTH.pack(len(payload)) + payload


class ChannelServer:
    """The replica's end: runs ``handlers[method](argument, peer)`` for every call of an
    authenticated connection, concurrently; ``peer`` numbers the connection, and ``on_close(peer)``
    runs when it closes (its owner died or let go of it)."""

    def __init__(self, replica: str, methods: ChannelMethods,
                 handlers: dict[str, Callable[[Any, int], Awaitable[Any]]], *, max_frame_bytes: int,
                 handshake_timeout_s: float, on_close: Callable[[int], None] = lambda peer: None):
        assert methods.keys() == handlers.keys()
        self._replica = replica
        self._codecs = _Codecs(methods)
        self._handlers = handlers
        self._max_frame_bytes = max_frame_bytes
        self._handshake_timeout_s = handshake_timeout_s
        self._on_close = on_close
        self._peers = itertools.count()
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self.refused = 0  # connections closed for a failed handshake or a broken frame
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def address(self, host: str) -> ChannelAddress:
        """Listen on ``host`` (started on the first call) and say where."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return ChannelAddress(self._replica, host, port, self._token, self._max_frame_bytes)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not await self._authenticate(reader):
            self.refused += 1
            writer.close()
            return
        peer = next(self._peers)
        try:
            while True:
                call_id, method, arg = self._decode_call(await read_frame(reader, self._max_frame_bytes))
                task = asyncio.get_running_loop().create_task(self._answer(writer, peer, call_id, method, arg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except FrameError as exc:
            self.refused += 1
            logger.warning("channel: closed a connection that broke the framing: %s", exc)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the loop's owner closed the connection
        finally:
            writer.close()
            self._on_close(peer)

    async def _authenticate(self, reader: asyncio.StreamReader) -> bool:
        """Whether the connection's first bytes are the token (read raw: nothing is decoded first)."""
        try:
            presented = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), self._handshake_timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            logger.warning("channel: closed a connection that sent no token within %.1f s", self._handshake_timeout_s)
            return False
        if not hmac.compare_digest(presented, self._token):
            logger.warning("channel: closed a connection with a wrong token")
            return False
        return True

    def _decode_call(self, frame: bytes) -> tuple[int, str, Any]:
        try:
            call: Call = CALL.decode(frame)
            codec = self._codecs.arguments.get(call.method)
            if codec is None:
                raise FrameError(f"unknown method {call.method[:40]!r}")
            return call.call_id, call.method, codec.decode(call.argument)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise FrameError(f"undecodable call: {exc}") from None

    async def _answer(self, writer: asyncio.StreamWriter, peer: int, call_id: int, method: str, arg: Any) -> None:
        try:
            result = self._codecs.results[method].encode(await self._handlers[method](arg, peer))
            reply = Reply(call_id, True, msgspec.Raw(result))
        except Exception as exc:  # the caller gets the failure, the channel lives on
            logger.exception("channel call %s failed", method)
            reply = Reply(call_id, False, msgspec.Raw(MESSAGE.encode(f"{type(exc).__name__}: {exc}")))
        if not writer.is_closing():
            writer.write(frame(ENVELOPE.encode(reply)))


class Channel:
    """The loop owner's end of one replica's channel; ``call`` may be awaited concurrently."""

    def __init__(self, address: ChannelAddress, methods: ChannelMethods, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, max_frame_bytes: int):
        self.address = address
        self._codecs = _Codecs(methods)
        self._max_frame_bytes = max_frame_bytes
        self._writer = writer
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))

    @classmethod
    async def open(cls, address: ChannelAddress, methods: ChannelMethods) -> Channel:
        try:
            reader, writer = await asyncio.open_connection(address.host, address.port)
        except OSError as exc:
            raise ChannelClosed(f"cannot reach replica {address.replica}: {exc}") from exc
        writer.write(address.token)
        return cls(address, methods, reader, writer, address.max_frame_bytes)

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    async def call(self, method: str, arg: Any, timeout_s: float) -> Any:
        """The replica's answer; ``ChannelClosed`` if it is gone or does not answer in ``timeout_s``
        (the channel is then closed: a late answer would belong to a step already given up)."""
        if self.closed:
            raise ChannelClosed(f"channel to replica {self.address.replica} is closed")
        call_id = next(self._ids)
        future = self._pending[call_id] = asyncio.get_running_loop().create_future()
        argument = self._codecs.arguments[method].encode(arg)
        self._writer.write(frame(ENVELOPE.encode(Call(call_id, method, msgspec.Raw(argument)))))
        try:
            ok, result = await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            self.close()
            raise ChannelClosed(f"replica {self.address.replica} did not answer {method} in {timeout_s} s") from None
        finally:
            self._pending.pop(call_id, None)
        try:
            if not ok:
                raise ChannelCallError(MESSAGE.decode(result))
            return self._codecs.results[method].decode(result)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ChannelCallError(f"replica {self.address.replica} answered {method} undecodably: {exc}") from None

    def close(self) -> None:
        self._writer.close()
        self._fail_pending()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                reply: Reply = REPLY.decode(await read_frame(reader, self._max_frame_bytes))
                future = self._pending.get(reply.call_id)
                if future is not None and not future.done():
                    future.set_result((reply.ok, reply.result))
        except (msgspec.DecodeError, msgspec.ValidationError, FrameError) as exc:
            logger.error("channel to replica %s: undecodable reply, closed: %s", self.address.replica, exc)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # the replica died or closed: fail what is in flight
        finally:
            self._writer.close()
            self._fail_pending()

    def _fail_pending(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosed(f"replica {self.address.replica} closed the channel"))
        self._pending.clear()

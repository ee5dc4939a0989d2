"""Direct channels: the separate topology's step loop talks to Draft and Target replicas over one
TCP connection per replica instead of a Serve handle call per step.

Why: a Serve handle call costs 1.3-2.5 ms of routing, gRPC and replica queueing per hop on this
machine, and a step takes two (docs/ARCHITECTURE.md, "Facts"); a frame over an open connection
costs a pickle and a socket write. The replicas stay Serve deployments (resources, replicas,
health checks, restarts, the dashboard): a session-pinned handle call finds the replica and returns
its ``ChannelAddress``, after which the steps go direct. A replica that dies closes its connection,
so every call in flight fails at once with ``ChannelClosed`` (a Serve call to a dead replica is held
until its replacement is up, ~15 s here).

Frames: a 4-byte big-endian length, then a pickle of ``(call_id, method, argument)`` one way and
``(call_id, ok, result_or_message)`` the other; calls are answered in any order. The replica draws a
random token that only the handle call reveals; a connection that does not present it first is
closed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import secrets
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ray.serve")

_LENGTH = struct.Struct("!I")


class ChannelClosed(ConnectionError):
    """The replica's end of the channel is gone (it died or restarted), or it never answered."""


class ChannelCallError(RuntimeError):
    """The replica ran the call and it failed there (the message says why)."""


@dataclass(frozen=True)
class ChannelAddress:
    replica: str  # the Serve replica's unique id
    host: str
    port: int
    token: str


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(length))  # the peer presented the replica's token


def _frame(obj: Any) -> bytes:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


class ChannelServer:
    """The replica's end: runs ``handlers[method](argument, peer)`` for every call, concurrently;
    ``peer`` numbers the connection, and ``on_close(peer)`` runs when it closes (its owner died or
    let go of it)."""

    def __init__(self, replica: str, handlers: dict[str, Callable[[Any, int], Awaitable[Any]]],
                 on_close: Callable[[int], None] = lambda peer: None):
        self._replica = replica
        self._handlers = handlers
        self._on_close = on_close
        self._peers = itertools.count()
        self._token = secrets.token_hex(16)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def address(self, host: str) -> ChannelAddress:
        """Listen on ``host`` (started on the first call) and say where."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return ChannelAddress(self._replica, host, port, self._token)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = next(self._peers)
        try:
            if await _read_frame(reader) != self._token:
                logger.warning("channel: a connection without the token was closed")
                return
            while True:
                call_id, method, arg = await _read_frame(reader)
                task = asyncio.get_running_loop().create_task(self._answer(writer, peer, call_id, method, arg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the loop's owner closed the connection
        finally:
            writer.close()
            self._on_close(peer)

    async def _answer(self, writer: asyncio.StreamWriter, peer: int, call_id: int, method: str, arg: Any) -> None:
        try:
            reply = (call_id, True, await self._handlers[method](arg, peer))
        except Exception as exc:  # the caller gets the failure, the channel lives on
            logger.exception("channel call %s failed", method)
            reply = (call_id, False, f"{type(exc).__name__}: {exc}")
        if not writer.is_closing():
            writer.write(_frame(reply))


class Channel:
    """The loop owner's end of one replica's channel; ``call`` may be awaited concurrently."""

    def __init__(self, address: ChannelAddress, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.address = address
        self._writer = writer
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))

    @classmethod
    async def open(cls, address: ChannelAddress) -> Channel:
        try:
            reader, writer = await asyncio.open_connection(address.host, address.port)
        except OSError as exc:
            raise ChannelClosed(f"cannot reach replica {address.replica}: {exc}") from exc
        writer.write(_frame(address.token))
        return cls(address, reader, writer)

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
        self._writer.write(_frame((call_id, method, arg)))
        try:
            ok, result = await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            self.close()
            raise ChannelClosed(f"replica {self.address.replica} did not answer {method} in {timeout_s} s") from None
        finally:
            self._pending.pop(call_id, None)
        if not ok:
            raise ChannelCallError(result)
        return result

    def close(self) -> None:
        self._writer.close()
        self._fail_pending()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, ok, result = await _read_frame(reader)
                future = self._pending.get(call_id)
                if future is not None and not future.done():
                    future.set_result((ok, result))
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

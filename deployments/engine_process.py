"""The engine in a process of its own: vLLM's engine-core process, with the replica as its front end.

Why: an engine replica's event loop streams every request's deltas over Ray. In one process that loop
(and Ray's own threads) share a GIL with the thread that steps the engine: torch releases it inside
each kernel, but a forward takes it back between its ops hundreds of times, and each time another
thread holds it the step waits. Measured here: a second thread holding the GIL 1 ms in every 5 slowed
batch-8 forwards of the served target 17.6 -> 25.3 ms, and served steps ran ~1.5x their in-process
time (BENCHMARKS.md, "The engine in a process of its own"). The child runs nothing but the engine: one
thread, one loop (take what arrived, step while there is work, send the step's deltas). The replica's
process keeps Ray, the streams and their coalescing.

The pipe: a socket pair made before the child starts, its end handed over as a file descriptor;
nothing listens, so no other process can reach it. Frames as the channel's (a 4-byte length, msgpack
decoded only into the declared types, ``deployments/wire.py``):
- replica -> engine: ``Start`` (the first frame), then lists of ``GenerateRequest | Abort | StatsQuery``;
- engine -> replica: ``Started`` or ``StartFailed`` (the first frame), then lists of
  ``Outputs | Rejected | StatsReply``.

The child ends when its pipe closes (the replica exited or was killed: the kernel closes its end),
which it checks between steps. A child that dies is reported to ``on_death``: the
replica then exits (``EngineReplica``), so the router migrates its requests as after any replica death.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployments.channel import FRAME_LENGTH, frame, read_frame
from deployments.config import AppConfig
from deployments.engine_hosts import build_engine, engine_fields, submit
from deployments.messages import Delta, GenerateRequest, ReplicaCosts
from deployments.wire import Codec
from specdec_core.async_engine import until_finished
from specdec_core.engine import Engine
from specdec_core.step_costs import StepCosts

logger = logging.getLogger("ray.serve")

MAX_FRAME_BYTES = 64 << 20  # both ends are this replica's own processes; the bound only catches a broken pipe
STATS_TIMEOUT_S = 30.0
PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)  # where the child imports this module from


@dataclass(frozen=True)
class Start:
    config: dict[str, Any]  # AppConfig's fields
    speculative: bool
    pool: str


@dataclass(frozen=True)
class Started:
    costs: dict[str, Any] | None  # StepCosts.to_dict() of the greedy path (None: no adaptive K)
    sampled: dict[str, Any] | None  # ... of the sampling path
    source: str | None


@dataclass(frozen=True)
class StartFailed:
    message: str


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class StatsQuery:
    call_id: int


@dataclass(frozen=True)
class Outputs:
    """One engine step: each row's delta, and the load after it (what autoscaling reads)."""

    deltas: list[tuple[str, Delta]]
    running: int
    waiting: int


@dataclass(frozen=True)
class Rejected:
    """The engine refused the request (``Engine.add_request``'s ValueError)."""

    request_id: str
    message: str


@dataclass(frozen=True)
class StatsReply:
    call_id: int
    fields: dict[str, Any]  # engine_fields()


START = Codec(Start)
STARTED = Codec(list[Started | StartFailed])  # one item: msgspec tells dataclasses apart in lists only
TO_ENGINE = Codec(list[GenerateRequest | Abort | StatsQuery])
FROM_ENGINE = Codec(list[Outputs | Rejected | StatsReply])


# ---- the child ------------------------------------------------------------------------------------


class BlockingPipe:
    """The child's end: whole frames in, whole frames out, blocking only where asked to."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buffer = bytearray()

    def send(self, payload: bytes) -> None:
        self.sock.sendall(frame(payload))

    def receive(self, block: bool) -> list[bytes] | None:
        """The frames that arrived (at least one when ``block``), or None once the replica is gone."""
        frames = []
        while True:
            frames += self._whole_frames()
            if frames or not (block or select.select([self.sock], [], [], 0)[0]):
                return frames
            data = self.sock.recv(1 << 20)
            if not data:
                return None
            self._buffer += data

    def _whole_frames(self) -> list[bytes]:
        frames = []
        while len(self._buffer) >= FRAME_LENGTH.size:
            (length,) = FRAME_LENGTH.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES:
                raise ConnectionError(f"frame of {length} bytes over the bound")
            if len(self._buffer) < FRAME_LENGTH.size + length:
                break
            frames.append(bytes(self._buffer[FRAME_LENGTH.size:FRAME_LENGTH.size + length]))
            del self._buffer[:FRAME_LENGTH.size + length]
        return frames


class EngineLoop:
    """The child's life after start-up: apply what arrived, step while there is work, send every
    step's deltas; block on the pipe only when idle."""

    def __init__(self, engine: Engine, pipe: BlockingPipe):
        self.engine, self.pipe = engine, pipe
        self.live: set[str] = set()  # requests added and not yet finished

    def run(self) -> None:
        while True:
            frames = self.pipe.receive(block=not self.engine.has_work())
            if frames is None:
                return  # the replica is gone
            replies = [reply for frame in frames for cmd in TO_ENGINE.decode(frame) if (reply := self._apply(cmd))]
            if self.engine.has_work():
                replies.append(self._step())
            if replies:
                self.pipe.send(FROM_ENGINE.encode(replies))

    def _apply(self, cmd: GenerateRequest | Abort | StatsQuery) -> Rejected | StatsReply | None:
        if isinstance(cmd, GenerateRequest):
            try:
                self.live.add(submit(self.engine, cmd))
            except ValueError as exc:
                return Rejected(cmd.request_id, str(exc))
        elif isinstance(cmd, Abort):
            if cmd.request_id in self.live:
                self.engine.abort(cmd.request_id)
        else:
            return StatsReply(cmd.call_id, engine_fields(self.engine))
        return None

    def _step(self) -> Outputs:
        try:
            outputs = self.engine.step()
        except Exception:  # the engine isolates a request's failure itself: this is the engine's own
            logger.exception("engine step failed; failing the requests in flight")
            return self._fail_all()
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
        return Outputs([(out.request_id, Delta.of(out)) for out in outputs], self.engine.num_running,
                       self.engine.num_waiting)

    def _fail_all(self) -> Outputs:
        failed, self.live = self.live, set()
        for rid in failed:
            self.engine.abort(rid)
        try:
            self.engine.step()  # processes the aborts, freeing slots
        except Exception:
            logger.exception("engine could not release requests after a failed step")
        return Outputs([(rid, Delta([], "", True, "error")) for rid in failed], self.engine.num_running,
                       self.engine.num_waiting)


def main(argv: list[str] | None = None) -> None:
    fd = int((argv or sys.argv[1:])[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the replica; this process ends with its pipe
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine[%(process)d] %(message)s")
    pipe = BlockingPipe(socket.socket(fileno=fd))
    frames = pipe.receive(block=True)
    if not frames:
        return
    start = START.decode(frames[0])
    try:
        engine, costs = build_engine(AppConfig(**start.config), start.speculative, start.pool)
    except Exception as exc:
        logger.exception("engine (%s) failed to start", start.pool)
        pipe.send(STARTED.encode([StartFailed(f"{type(exc).__name__}: {exc}")]))
        return
    # Served steps at batch 8 ran 1.0-1.5x the in-process engine's from one start to the next, with the kernels
    # each start's probes chose (BENCHMARKS.md, "Closed-loop rounds"): the log says what this start chose.
    logger.info("engine (%s): the target's packed-kernel rows %s", start.pool, engine.target.kernel_bands())
    pipe.send(STARTED.encode([Started(costs.costs.to_dict() if costs else None,
                                      costs.sampled.to_dict() if costs and costs.sampled else None,
                                      costs.source if costs else None)]))
    EngineLoop(engine, pipe).run()


# ---- the replica's end ----------------------------------------------------------------------------


class EngineDied(RuntimeError):
    """The engine process is gone; every request in flight on it failed."""


class EngineProcess:
    """Starts the engine process and talks to it from the replica's event loop. ``on_death`` runs
    once if the process dies while in use (the replica passes one that exits the replica)."""

    def __init__(self, cfg: AppConfig, speculative: bool, pool: str,
                 on_death: Callable[[], None] = lambda: None):
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (PROJECT_ROOT, os.environ.get("PYTHONPATH"))))}
        self._proc = subprocess.Popen([sys.executable, "-m", "deployments.engine_process", str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self._sock, self._on_death = ours, on_death
        self._stopping = self._dead = False
        try:
            self.costs = self._handshake(Start(cfg.model_dump(), speculative, pool))
        except BaseException:
            self.shutdown()
            raise
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._opened: asyncio.Future | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._load = (0, 0)

    def _handshake(self, start: Start) -> ReplicaCosts | None:
        """Start the engine and wait for it (model load and calibration: seconds to minutes)."""
        pipe = BlockingPipe(self._sock)
        pipe.send(START.encode(start))
        frames = pipe.receive(block=True)
        if not frames:
            raise EngineDied(f"the engine process exited while starting (exit code {self._proc.wait()})")
        (started,) = STARTED.decode(frames[0])
        if isinstance(started, StartFailed):
            raise RuntimeError(f"the engine process failed to start: {started.message}")
        if started.costs is None:
            return None
        sampled = StepCosts.from_dict(started.sampled) if started.sampled else None
        return ReplicaCosts(StepCosts.from_dict(started.costs), sampled, started.source)

    async def _open(self) -> None:
        if self._opened is None:
            self._opened = asyncio.ensure_future(self._connect())
        await self._opened

    async def _connect(self) -> None:
        self._sock.setblocking(False)
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock, limit=MAX_FRAME_BYTES)
        asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                for item in FROM_ENGINE.decode(await read_frame(reader, MAX_FRAME_BYTES)):
                    self._dispatch(item)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._gone()

    def _dispatch(self, item: Outputs | Rejected | StatsReply) -> None:
        if isinstance(item, Outputs):
            self._load = (item.running, item.waiting)
            for rid, delta in item.deltas:
                if (queue := self._streams.get(rid)) is not None:
                    queue.put_nowait(delta)
        elif isinstance(item, Rejected):
            if (queue := self._streams.get(item.request_id)) is not None:
                queue.put_nowait(ValueError(item.message))
        elif (future := self._calls.pop(item.call_id, None)) is not None and not future.done():
            future.set_result(item.fields)

    def _gone(self) -> None:
        self._dead = True
        error = EngineDied(f"the engine process exited (exit code {self._proc.poll()})")
        for queue in self._streams.values():
            queue.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        if not self._stopping:
            logger.error("%s", error)
            self._on_death()

    def _send(self, commands: list) -> None:
        if not self.alive():
            raise EngineDied("the engine process is gone")
        self._writer.write(frame(TO_ENGINE.encode(commands)))

    async def stream(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        """One ``Delta`` per engine step that advanced the request; the last has ``finished``.
        ValueError if the engine refuses it; leaving early aborts it in the engine."""
        await self._open()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = queue
        finished = False
        try:
            self._send([req])
            async for item in until_finished(queue, req.request_id):
                finished = item.finished
                yield item
        finally:
            self._streams.pop(req.request_id, None)
            if not finished and self.alive():
                self._send([Abort(req.request_id)])

    async def fields(self) -> dict:
        await self._open()
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._send([StatsQuery(call_id)])
        try:
            return await asyncio.wait_for(future, STATS_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)

    def load(self) -> tuple[int, int]:
        """Running and waiting sequences after the engine's last step."""
        return self._load

    def alive(self) -> bool:
        return not self._dead and self._proc.poll() is None

    def shutdown(self) -> None:
        self._stopping = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # both ends read the pipe's end: the child exits, our reader ends
        except OSError:
            pass  # already shut down
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


if __name__ == "__main__":
    main()

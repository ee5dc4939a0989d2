"""Asyncio front of the engine: one background thread runs ``Engine.step`` while work exists, and
each request's outputs reach its caller through its own asyncio queue. Torch releases the GIL in
its kernels, so the event loop (HTTP, Ray calls) stays responsive during steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, TypeVar

from specdec_core.engine import Engine, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class Mergeable(Protocol):
    finished: bool

    def merged(self, later: Any) -> Any: ...


M = TypeVar("M", bound=Mergeable)


async def coalesced(outputs: AsyncIterator[M], interval_s: float | None) -> AsyncIterator[M]:
    """The outputs of a request's steps (``RequestOutput``s, or a replica's ``Delta``s), merged into one
    per ``interval_s`` (the first and the last go out at once; None: one output at the end): every
    message a stream sends costs its sender, the router and the proxy CPU time that the steps share."""
    pending, sent_at = None, float("-inf")  # the first tokens go out at once (time to first token)
    async for out in outputs:
        pending = out if pending is None else pending.merged(out)
        if out.finished or (interval_s is not None and time.perf_counter() - sent_at >= interval_s):
            sent_at = time.perf_counter()
            yield pending
            pending = None


class RequestFailed(RuntimeError):
    """This request alone failed an engine step (the others in its batch went on)."""


async def until_finished(queue: asyncio.Queue, request_id: str) -> AsyncIterator:
    """A request's outputs as they reach its queue, up to the finished one. An exception on the queue is
    raised; an output that finished with "error" raises ``RequestFailed``."""
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finish_reason == "error":
            raise RequestFailed(f"request {request_id} failed in the engine (see the replica log)")
        yield item
        if item.finished:
            return


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="specdec-engine", daemon=True)
        self._thread.start()

    async def stream(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None,
        resume: tuple[list[int], int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive; the last one has ``finished=True``. Leaving the iterator
        early (client disconnect, cancellation) aborts the request and frees its slots."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._wake:
            rid = self.engine.add_request(prompt, params, request_id, resume)  # ValueError on bad input
            self._streams[rid] = (asyncio.get_running_loop(), queue)
            self._wake.notify()
        finished = False
        try:
            async for item in until_finished(queue, rid):
                finished = item.finished
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.engine.abort(rid)
                with self._wake:
                    self._wake.notify()

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestOutput:
        final = None
        async for out in self.stream(prompt, params, request_id):
            final = out
        return final

    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self.engine.has_work():
                    self._wake.wait()
                if self._stopped:
                    return
            try:
                outputs = self.engine.step()
            except Exception as exc:
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)
                continue
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, out)

    def _fail_all(self, exc: Exception) -> None:
        for rid, (loop, queue) in list(self._streams.items()):
            self.engine.abort(rid)
            loop.call_soon_threadsafe(queue.put_nowait, RuntimeError(f"engine step failed: {exc}"))
        try:
            self.engine.step()  # processes the aborts, freeing slots
        except Exception:
            logger.exception("engine could not release requests after a failed step")

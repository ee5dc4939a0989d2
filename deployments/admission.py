"""Admission: the router's bounded number of requests in flight (no Ray here).

At most ``limit`` requests are served at once; one more gets a 503 at once (an OpenAI error
body) rather than an unbounded backlog. A ``Slot`` is held from planning to the end of the
response and released exactly once, also when a streaming client leaves before its body started.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import StreamingResponse

from deployments.api import APIError
from deployments.metrics import RouterMetrics


class Admission:
    def __init__(self, limit: int, metrics: RouterMetrics):
        self.limit = limit
        self.inflight = 0
        self._metrics = metrics

    def check(self) -> None:
        """Raise the 503 if a new request would exceed the limit."""
        if self.inflight >= self.limit:
            self._metrics.rejected.inc(tags={"status": "503"})
            raise APIError(503, f"server overloaded: {self.inflight} requests in flight "
                                f"(max_inflight_requests={self.limit}); retry later",
                           "server_error", None, "overloaded")

    def admit(self, on_release: Callable[[], None] | None = None) -> Slot:
        """A slot; ``on_release`` runs with its release."""
        return Slot(self, on_release)

    def _add(self, n: int) -> None:
        self.inflight += n
        self._metrics.inflight.set(self.inflight)


class Slot:
    """One in-flight request's place; released exactly once."""

    def __init__(self, admission: Admission, on_release: Callable[[], None] | None = None):
        self._admission = admission
        self._on_release = on_release
        self._released = False
        admission._add(1)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._add(-1)
            if self._on_release is not None:
                self._on_release()

    def __del__(self):  # a stream whose body never started still gives its slot back
        self.release()


class AdmittedStreamingResponse(StreamingResponse):
    """Releases the slot when the ASGI call ends, also when the client left before the body
    generator ever started (then the generator's own ``finally`` never runs)."""

    def __init__(self, content, slot: Slot, **kwargs):
        super().__init__(content, **kwargs)
        self._slot = slot

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()
            await self.body_iterator.aclose()

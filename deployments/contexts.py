"""Token contexts sent as changes: the separate topology's step messages carry what changed in a
session's context since the last message to that replica, not the whole history.

The loop's owner keeps, per replica, the context it last sent each session (``SentContexts``); a
message says "keep your first ``start`` tokens, append ``tokens``" (``SessionContext``). The
replica keeps its copy (``ReplicaContexts``) and rebuilds the full context, which its model runner
reconciles its KV cache against (``specdec_core.slots``). A replica that cannot apply a change (it
restarted, or never saw the session) answers ``Resync`` and the owner sends the whole context. The
Draft's context may end in proposed tokens not yet verified: the next change cuts them (``start``
below its length), so a rejection needs no rollback message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deployments.messages import SessionContext
from specdec_core import SamplingParams


@dataclass
class _Held:
    tokens: list[int]
    params: SamplingParams


class ReplicaContexts:
    """A replica's copy of each session's context and sampling parameters."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def apply(self, ctx: SessionContext) -> tuple[list[int], SamplingParams] | None:
        """The session's full context after the change, with its parameters; None: resync."""
        held = self._held.get(ctx.session_id)
        if ctx.start == 0 and ctx.params is not None:
            held = self._held[ctx.session_id] = _Held(list(ctx.tokens), ctx.params)
        elif held is None or ctx.start > len(held.tokens):
            return None
        else:
            del held.tokens[ctx.start:]
            held.tokens += ctx.tokens
        return held.tokens, held.params

    def drop(self, session_id: str) -> None:
        self._held.pop(session_id, None)


@dataclass
class SentContexts:
    """What the loop's owner last sent each session on one replica's channel. ``known`` is the
    length of that context's committed part (the request's history then): histories only grow, so
    the next context shares it and only the tokens after it are compared."""

    _sent: dict[str, tuple[list[int], int]] = field(default_factory=dict)

    def change(self, session_id: str, context: list[int], committed: int, params: SamplingParams) -> SessionContext:
        """The message that turns what the replica holds into ``context`` (its first ``committed``
        tokens are the request's history) and records it as sent."""
        prev = self._sent.get(session_id)
        self._sent[session_id] = (context, committed)
        if prev is None:
            return SessionContext(session_id, 0, list(context), params)
        old, known = prev
        start = min(known, len(old), len(context))
        while start < len(old) and start < len(context) and old[start] == context[start]:
            start += 1
        return SessionContext(session_id, start, context[start:])

    def forget(self, session_id: str) -> None:
        """The replica lost (or never had) the session: the next message sends the whole context."""
        self._sent.pop(session_id, None)

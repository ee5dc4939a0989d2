"""The typed messages that cross the serving layer's Ray boundaries (no Ray here).

Router -> engine replica: ``GenerateRequest``; engine replica (or the separate loop) -> router:
``Delta``. The separate topology's step messages (over ``deployments/channel.py``) carry a
``ProposeStepItem`` or ``VerifyStepItem`` per session, each with the change to the session's context
(``SessionContext``, ``SamplingParams`` on a session's first message), and the engine's own types
back: ``Proposal`` from the Draft, ``VerifyResult`` from the Target (``specdec_core``), or
``Resync`` / ``ItemFailed`` for one item. A co-located replica's step costs come as
``ReplicaCosts``; every replica's load and state as its
``...Stats`` (the router turns them into JSON only at the HTTP edge, ``GET /v1/stats``). Each side
builds and reads these dataclasses, never a dict by string key, so a field added on one side is a
field the other can see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec_core import Proposal, RequestOutput, RequestStats, SamplingParams, VerifyResult
from specdec_core.drift import StepDrift
from specdec_core.step_costs import StepCosts


@dataclass(frozen=True)
class Resume:
    """Where a migrated request continues: the tokens already emitted to the client and the
    characters of text already sent (the new replica prefills prompt + these and emits only what
    comes after)."""

    output_ids: list[int]
    sent_chars: int


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # validated and normalized by the router
    stream_interval_s: float | None = None  # coalesce steps into one delta per interval; None: one delta at the end
    resume: Resume | None = None
    drift: StepDrift | None = None  # the router's drift, for an adaptive request: the replica prices with it


@dataclass(frozen=True)
class Progress:
    """A running request's decode steps so far, by kind. The router learns from it what a pool's adaptive K
    declines while the request still decodes (``LoadLessons.learn_declined``), where its last delta's
    stats come a whole request later."""

    plain_steps: int = 0  # decode steps at K=0 (its prefill's pass is not one)
    verify_steps: int = 0
    batch_rows: int = 0  # the decode batch of each of its decode steps, summed

    @classmethod
    def of(cls, stats: RequestStats) -> Progress:
        return cls(stats.plain_decode_steps, stats.verify_steps, stats.decode_batch_rows)

    @property
    def steps(self) -> int:
        return self.plain_steps + self.verify_steps

    def since(self, earlier: Progress) -> Progress:
        return Progress(self.plain_steps - earlier.plain_steps, self.verify_steps - earlier.verify_steps,
                        self.batch_rows - earlier.batch_rows)


@dataclass(frozen=True)
class Delta:
    """What a request produced since its previous delta; ``stats`` only on the last one, ``progress`` on
    the others."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    stats: RequestStats | None = None
    progress: Progress | None = None

    @classmethod
    def of(cls, out: RequestOutput) -> Delta:
        if out.finished:
            return cls(out.new_token_ids, out.new_text, True, out.finish_reason, out.stats)
        return cls(out.new_token_ids, out.new_text, progress=Progress.of(out.stats))

    def merged(self, later: Delta) -> Delta:
        """This delta followed by ``later``, as one (what a stream sends when it coalesces steps)."""
        return Delta(self.token_ids + later.token_ids, self.text + later.text, later.finished, later.finish_reason,
                     later.stats, later.progress)


@dataclass(frozen=True)
class ReplicaCosts:
    """A co-located replica's calibrated step costs, and where they came from."""

    costs: StepCosts  # the greedy path
    sampled: StepCosts | None  # the sampling path (None: a calibration file's greedy costs price it too)
    source: str  # "calibrated:<device>" or "file:<name>"


@dataclass(frozen=True)
class EngineStats:
    pool: str
    replica: str
    running: int
    waiting: int
    free_slots: int
    total_slots: int
    target_sessions: int
    draft_sessions: int
    draft_free_slots: int | None
    streams: int
    served: int
    aborted: int
    adaptive: bool
    costs_source: str | None
    # adaptive K's drift (the router's, once a request brought it), per batch bucket (log2)
    drift: dict = field(default_factory=dict)
    # automatic prefix caching per model ("target", "draft"): PrefixCache.stats(); empty when off
    prefix_cache: dict = field(default_factory=dict)

    @property
    def sessions(self) -> int:
        return self.target_sessions + self.draft_sessions


@dataclass(frozen=True)
class SideStats:
    """A Draft or Target replica of the separate topology."""

    deployment: str  # "Draft" | "Target"
    replica: str
    sessions: int
    free_slots: int
    total_slots: int
    max_batch: int
    sessions_opened: int = 0  # Target only
    batches: int = 0  # Target only


@dataclass(frozen=True)
class Placement:
    """Where a session-pinned call landed (Draft/Target ``where``)."""

    replica: str
    holds: bool  # the replica holds the session's KV cache


# The separate topology's step messages (deployments/channel.py carries them; contexts.py builds them).


@dataclass(frozen=True)
class SessionContext:
    session_id: str
    start: int  # the replica keeps this many tokens of the context it holds ...
    tokens: list[int]  # ... and appends these
    params: SamplingParams | None = None  # sent with start == 0 (a new session, or a resync)


@dataclass(frozen=True)
class Resync:
    """The replica cannot apply a change to a context it does not hold: send the whole context."""


@dataclass(frozen=True)
class ItemFailed:
    """One item of a step failed on the replica (the other items of the step still succeed)."""

    message: str


@dataclass(frozen=True)
class ProposeStepItem:
    """Draft: propose ``k`` tokens after the session's context."""

    context: SessionContext
    k: int


@dataclass(frozen=True)
class VerifyStepItem:
    """Target: verify ``proposal`` after the session's context (None: a plain step, or the prefill)."""

    context: SessionContext
    proposal: Proposal | None


# What each side's channel may be sent, and answers: method -> (argument type, result type). A
# frame decodes into these types only (deployments/wire.py).
DRAFT_METHODS = {"step": (list[ProposeStepItem], list[Proposal | Resync | ItemFailed]), "release": (list[str], int)}
TARGET_METHODS = {"step": (list[VerifyStepItem], list[VerifyResult | Resync | ItemFailed]),
                  "release": (list[str], int)}

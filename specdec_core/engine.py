"""The in-process engine: continuous batching of plain and speculative requests.

One ``step`` = (1) admit waiting requests and prefill them in one target pass, which emits their
first token; (2) for every running request choose its K (K=0 is plain decoding), let the proposer
draft K tokens for the speculative ones, batched, and (3) verify all of them, plain rows included,
in one batched target pass (``Verifier``, Leviathan et al. 2023, Algorithm 1). Requests join and
leave only at step boundaries.

The engine owns each request's authoritative token history; the proposer and verifier hold KV
caches as soft state keyed by request id and reconcile against that history on every call.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import torch

from specdec_core.acceptance import AcceptanceTracker, TrafficClass
from specdec_core.adaptive import AdaptiveK, KState, Regret, stop
from specdec_core.calibration import calibrate
from specdec_core.cost_view import CostView
from specdec_core.costmodel import StepCosts
from specdec_core.loading import load_models
from specdec_core.proposers import Proposal, ProposalRequest, Proposer
from specdec_core.request import RequestOutput, RequestState, SamplingParams, eos_token_ids, resumed_seed
from specdec_core.runner import ModelRunner
from specdec_core.stats import StepTiming
from specdec_core.verifier import Verifier, VerifyItem

logger = logging.getLogger(__name__)


class _Request(RequestState):
    """A request's state plus what only the engine needs: its random stream and speculation state."""

    def __init__(self, request_id, prompt_ids, params, tokenizer, eos_ids, generator):
        super().__init__(request_id, prompt_ids, params, tokenizer, eos_ids)
        self.generator = generator
        self.draft_failed = False
        self.k_state: KState | None = None  # adaptive K of this request
        self.traffic_class: TrafficClass | None = None  # its acceptance class, once adaptive K asks
        self.draft_seen = 0  # history length the draft has fed (its proposals count until rejected)
        self.regret = Regret()  # adaptive K's guard: what its speculative steps cost against plain ones

    @property
    def draft_catch_up(self) -> int:
        """Tokens the draft must feed before it can propose: one after a speculative step (the
        recovered or bonus token), every token emitted since then after plain steps."""
        return max(1, len(self.tokens) - self.draft_seen)


class Engine:
    def __init__(
        self,
        target: ModelRunner,
        tokenizer,
        proposer: Proposer | None = None,
        max_batch_size: int = 32,
        adaptive: AdaptiveK | None = None,
    ):
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.verifier = Verifier(target)
        self.max_batch_size = min(max_batch_size, target.num_slots)
        self.adaptive = adaptive
        self.max_model_len = target.max_len
        self.eos_token_ids = eos_token_ids(tokenizer, target.model.generation_config)
        self.last_step = StepTiming()
        self._incoming: deque[_Request] = deque()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, target: str, draft: str | None = None, proposer: str | None = None, *, device: str | None = None,
        dtype: str | torch.dtype | None = None, max_batch_size: int = 32, max_model_len: int = 1024,
        trust_remote_code: bool = False, ngram_max_n: int = 4,
    ) -> Engine:
        """Load a target and its proposer from local paths or hub names (``loading.load_models``):
        ``proposer`` is "draft" (needs ``draft``) or "ngram", by default "draft" when a draft is given."""
        target_runner, tokenizer, prop = load_models(
            target, draft, proposer, device=device, dtype=dtype, max_slots=max_batch_size,
            max_len=max_model_len, trust_remote_code=trust_remote_code, ngram_max_n=ngram_max_n,
        )
        return cls(target_runner, tokenizer, prop, max_batch_size=max_batch_size)

    def enable_adaptive(
        self, costs: StepCosts | None = None, tracker: AcceptanceTracker | None = None, topology: str = "colocated",
        sampled_costs: StepCosts | None = None,
    ) -> AdaptiveK:
        """Turn on per-step adaptive K for requests with ``adaptive_k=True``. Without ``costs`` both
        the greedy and the sampling path are calibrated now; ``sampled_costs`` None otherwise means
        sampled requests are priced with ``costs``."""
        if self.proposer is None:
            raise ValueError("adaptive K needs a proposer")
        if costs is None:
            long = self.max_model_len // 2
            costs = calibrate(self, long_context_len=long)
            sampled_costs = sampled_costs or calibrate(self, temperature=1.0, long_context_len=long)
        self.adaptive = AdaptiveK(CostView(costs, sampled_costs), tracker or AcceptanceTracker(), self.proposer.name,
                                  topology)
        return self.adaptive

    # ---- requests ----------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        ids = [int(t) for t in prompt]
        if any(t < 0 or t >= self.target.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.target.vocab_size})")
        return ids

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None,
        resume: tuple[list[int], int] | None = None,
    ) -> str:
        """Queue a request (thread-safe); it joins the batch at the next step boundary. ``resume``
        (output token ids so far, characters of their text already sent) continues a request that
        another replica started: its prefill covers prompt + output, its budget counts the output."""
        params.validate()
        params = params.normalized(self.target.vocab_size)
        prompt_ids = self.encode(prompt)
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context limit of {self.max_model_len} tokens"
            )
        if params.num_speculative_tokens > 0 and self.proposer is None:
            raise ValueError("speculative decoding requested but the engine has no proposer")
        generator = None
        if params.temperature > 0:
            generator = torch.Generator()
            if params.seed is not None:
                generator.manual_seed(params.seed if resume is None else resumed_seed(params.seed, len(resume[0])))
            else:
                generator.seed()
        req = _Request(
            request_id or f"req-{next(self._ids)}", prompt_ids, params, self.tokenizer, self.eos_token_ids, generator
        )
        if resume is not None:
            req.resume(*resume)
        self._incoming.append(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request finishes with reason "abort" and frees its slots at the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        return bool(self._incoming or self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._incoming) + len(self._waiting)

    # ---- the step ----------------------------------------------------------------------------

    def step(self, stream_text: bool = True) -> list[RequestOutput]:
        """Run one engine step. ``stream_text=False`` skips per-step detokenization (the text is
        then only set on a request's final output), for callers that only want finished results."""
        t0 = time.perf_counter()
        timing = StepTiming()
        while self._incoming:
            self._waiting.append(self._incoming.popleft())
        outputs = self._process_aborts()
        # Rows in slot order: a run of consecutive slots is read as a view, not gathered.
        decoding = sorted(self._running, key=lambda r: self.verifier.slots.slot(r.request_id))
        admitted = []
        while self._waiting and len(self._running) < self.max_batch_size and self.target.num_free_slots:
            req = self._waiting.popleft()
            self._running.append(req)
            admitted.append(req)
        try:
            self._prefill_and_decode(admitted, decoding, timing)
        except Exception:
            logger.exception("engine step failed; retrying its %d request(s) one at a time",
                             len(admitted) + len(decoding))
            self._isolate_failure(admitted, decoding)
        timing.total_s = time.perf_counter() - t0
        self.last_step = timing
        for req in decoding:
            req.stats.decode_s += timing.total_s - timing.prefill_s
        outputs += [r.output(stream_text) for r in admitted + decoding]
        self._running = [r for r in self._running if r.finish_reason is None]
        return outputs

    def _prefill_and_decode(self, admitted: list[_Request], decoding: list[_Request], timing: StepTiming) -> None:
        if admitted:
            t = time.perf_counter()
            self._verify_and_commit(admitted, [Proposal([], None)] * len(admitted))
            timing.prefill_s = time.perf_counter() - t
            timing.prefill_rows = len(admitted)
            for req in admitted:
                req.stats.prefill_s = time.perf_counter() - req.arrival
                req.stats.first_token_s = req.stats.prefill_s
        if decoding:
            self._decode(decoding, timing)

    def _isolate_failure(self, admitted: list[_Request], decoding: list[_Request]) -> None:
        """A failed step fails only the requests that fail alone: each is retried as a step of its
        own. Retrying is safe because the caches reconcile against each request's history
        (``SequenceSlots.sync``); rows the failed step already committed simply take another step."""
        for req in admitted + decoding:
            if req.finished:
                continue
            alone = [req]
            try:
                self._prefill_and_decode(alone if req in admitted else [], alone if req in decoding else [],
                                         StepTiming())
            except Exception:
                logger.exception("request %s fails a step on its own; it ends with an error", req.request_id)
                req.finish("error")
                self._release(req)

    def _decode(self, rows: list[_Request], timing: StepTiming) -> None:
        batch = len(rows)
        ks = [self._choose_k(r, batch) for r in rows]
        if self.adaptive is not None and batch > 1:
            ks = self.adaptive.unless_batch_loses(
                ks, [r.params.adaptive_k for r in rows], [self._traffic_class(r) for r in rows],
                [(r.stats.accepted, sum(r.stats.proposed_per_position), r.params.class_acceptance) for r in rows],
                max(len(r.tokens) for r in rows),
            )
        catch_up = max(r.draft_catch_up for r in rows)
        t = time.perf_counter()
        proposals = self._propose(rows, ks)
        timing.propose_s = time.perf_counter() - t
        t = time.perf_counter()
        before = [len(r.output_ids) for r in rows]
        self._verify_and_commit(rows, proposals)
        timing.verify_s = time.perf_counter() - t
        if self.adaptive is not None:
            self._account_regret(rows, proposals, before, timing.propose_s + timing.verify_s)
        proposed = {len(p.token_ids) for p in proposals}
        timing.batch = batch
        timing.speculative_rows = sum(1 for p in proposals if p.token_ids)
        timing.k = max(proposed)
        # Steps whose rows all proposed K tokens teach adaptive K how far real steps run from the
        # calibration; a draft's catch-up prefill (after plain steps) is not a step cost: skipped.
        if self.adaptive is not None and len(proposed) == 1 and (proposed == {0} or catch_up <= 2):
            self.adaptive.observe_step(self._traffic_class(rows[0]), max(len(r.tokens) for r in rows), batch,
                                       proposed.pop(), timing.propose_s + timing.verify_s)

    def _account_regret(self, rows: list[_Request], proposals: list[Proposal], before: list[int],
                        step_s: float) -> None:
        """Charge each adaptive row that speculated against plain steps at this batch for the tokens
        it emitted; a row over its budget decodes plain to its end (``adaptive.stop``)."""
        for req, prop, n0 in zip(rows, proposals, before):
            if prop.token_ids and req.params.adaptive_k and req.k_state is not None:
                plain_step = self.adaptive.plain_step_time(self._traffic_class(req), len(req.tokens), len(rows))
                if req.regret.charge(step_s, len(req.output_ids) - n0, plain_step, len(req.output_ids)):
                    req.k_state = stop(req.k_state)

    def _choose_k(self, req: _Request, batch: int) -> int:
        if req.draft_failed or self.proposer is None:
            return 0
        k = req.params.num_speculative_tokens
        if req.params.adaptive_k and self.adaptive is not None and k > 0:
            req.k_state = self.adaptive.choose(
                req.k_state, self._traffic_class(req), req.stats.accepted, sum(req.stats.proposed_per_position),
                batch, k, remaining_tokens=req.params.max_new_tokens - len(req.output_ids),
                catch_up_tokens=req.draft_catch_up, context_len=len(req.tokens),
                class_estimate=req.params.class_acceptance,
            )
            k = req.k_state.k
        return req.budget_k(k, self.max_model_len)

    def _propose(self, rows: list[_Request], ks: list[int]) -> list[Proposal]:
        proposals = [Proposal([], None) for _ in rows]
        spec = [i for i, k in enumerate(ks) if k > 0]
        if not spec:
            return proposals
        for i in spec:
            rows[i].draft_seen = len(rows[i].tokens) + ks[i]
        requests = [
            ProposalRequest(
                rows[i].request_id, rows[i].tokens, ks[i],
                rows[i].params.temperature, rows[i].params.top_p, rows[i].params.top_k, rows[i].generator,
            )
            for i in spec
        ]
        try:
            for i, prop in zip(spec, self.proposer.propose(requests)):
                proposals[i] = prop
        except Exception:
            # A failed draft degrades these requests to plain decoding; it never loses them.
            logger.exception("proposer failed; %d request(s) fall back to plain decoding", len(spec))
            for i in spec:
                rows[i].draft_failed = True
                self.proposer.release(rows[i].request_id)
        return proposals

    def _verify_and_commit(self, rows: list[_Request], proposals: list[Proposal]) -> None:
        items = [
            VerifyItem(
                r.request_id, r.tokens, p, r.params.temperature, r.params.top_p, r.params.top_k, r.generator
            )
            for r, p in zip(rows, proposals)
        ]
        for req, res in zip(rows, self.verifier.verify(items)):
            req.stats.record_verify(res.num_proposed, res.num_accepted)
            if self.adaptive is not None and res.num_proposed:
                self.adaptive.observe(self._traffic_class(req), res.num_proposed, res.num_accepted)
            self._commit(req, res.emitted)

    def _traffic_class(self, req: _Request) -> TrafficClass:
        if req.traffic_class is None:  # fixed for the request's life; asked several times a step
            req.traffic_class = self.adaptive.traffic_class(req.params.temperature, req.params.domain)
        return req.traffic_class

    def _commit(self, req: _Request, emitted: list[int]) -> None:
        req.commit(emitted)
        if req.finished:
            self._release(req)

    def _release(self, req: _Request) -> None:
        self.verifier.release(req.request_id)
        if self.proposer is not None:
            self.proposer.release(req.request_id)

    def _process_aborts(self) -> list[RequestOutput]:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
        if not aborts:
            return []
        outputs = []
        for req in [r for r in self._waiting if r.request_id in aborts]:
            self._waiting.remove(req)
            req.finish("abort")
            outputs.append(req.output())
        for req in self._running:
            if req.request_id in aborts:
                req.finish("abort")
                self._release(req)
                outputs.append(req.output())
        self._running = [r for r in self._running if r.finish_reason is None]
        return outputs

    # ---- convenience -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        mode: str = "speculative",
        num_speculative_tokens: int = 4,
        seed: int | None = 0,
        stop: Sequence[str] = (),
        params: Sequence[SamplingParams] | None = None,
        trace: list[StepTiming] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion, batched. Request i is seeded with ``seed + i``; ``params`` (one
        per prompt) overrides the scalar arguments, e.g. to mix plain and speculative requests.
        ``mode="auto"`` re-chooses K each step up to ``num_speculative_tokens`` (``enable_adaptive``
        first), dropping to plain steps where speculation does not pay. ``trace``, if given, receives
        every step's ``StepTiming``."""
        if params is None:
            if mode not in ("speculative", "plain", "auto"):
                raise ValueError(f"mode must be 'speculative', 'plain' or 'auto', got {mode!r}")
            if mode == "auto" and self.adaptive is None:
                raise ValueError("mode='auto' needs engine.enable_adaptive() first")
            k = 0 if mode == "plain" else num_speculative_tokens
            params = [
                SamplingParams(
                    max_new_tokens, temperature, top_p, top_k, None if seed is None else seed + i, tuple(stop),
                    num_speculative_tokens=k, adaptive_k=mode == "auto",
                )
                for i in range(len(prompts))
            ]
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} params for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        while self.has_work():
            for out in self.step(stream_text=False):
                if out.finished:
                    done[out.request_id] = out
            if trace is not None:
                trace.append(self.last_step)
        return [done[i] for i in ids]


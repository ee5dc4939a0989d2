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

import dataclasses
import functools
import itertools
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec_core.acceptance import AcceptanceTracker, TrafficClass
from specdec_core.adaptive import AdaptiveK, KState
from specdec_core.costmodel import CostModel, StepCosts, calibrate, fit_draft_cost
from specdec_core.proposers import DraftModelProposer, NgramProposer, Proposal, ProposalRequest, Proposer
from specdec_core.request import RequestOutput, RequestState, SamplingParams, eos_token_ids
from specdec_core.runner import ModelRunner, load_tokenizer
from specdec_core.verifier import Verifier, VerifyItem

logger = logging.getLogger(__name__)


@dataclass
class StepTiming:
    batch: int = 0  # running requests in the decode pass
    speculative_rows: int = 0
    prefill_rows: int = 0
    propose_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0


class _Request(RequestState):
    """A request's state plus what only the engine needs: its random stream and speculation state."""

    def __init__(self, request_id, prompt_ids, params, tokenizer, eos_ids, generator):
        super().__init__(request_id, prompt_ids, params, tokenizer, eos_ids)
        self.generator = generator
        self.draft_failed = False
        self.k_state: KState | None = None  # adaptive K of this request
        self.traffic_class: TrafficClass | None = None  # its acceptance class, once adaptive K asks
        self.draft_seen = 0  # history length the draft has fed (its proposals count until rejected)

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
        cls,
        target: str,
        draft: str | None = None,
        proposer: str | None = None,
        *,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        max_batch_size: int = 32,
        max_model_len: int = 1024,
        trust_remote_code: bool = False,
        ngram_max_n: int = 4,
    ) -> Engine:
        """Load a target and optionally a draft from local paths or hub names.

        ``proposer`` is "draft" (needs ``draft``) or "ngram"; by default "draft" when a draft is
        given, else "ngram", so every engine can speculate.
        """
        proposer = proposer or ("draft" if draft else "ngram")
        if proposer not in ("draft", "ngram"):
            raise ValueError(f"proposer must be 'draft' or 'ngram', got {proposer!r}")
        if proposer == "draft" and not draft:
            raise ValueError("proposer='draft' needs a draft model path")
        tokenizer = load_tokenizer(target, trust_remote_code)
        runner_kw = dict(
            device=device, dtype=dtype, max_slots=max_batch_size, max_len=max_model_len,
            trust_remote_code=trust_remote_code,
        )
        target_runner = ModelRunner.from_pretrained(target, **runner_kw)
        prop: Proposer
        if proposer == "draft":
            check_same_tokenizer(tokenizer, load_tokenizer(draft, trust_remote_code), target, draft)
            draft_runner = ModelRunner.from_pretrained(draft, **runner_kw)
            if draft_runner.vocab_size != target_runner.vocab_size:
                raise ValueError(
                    f"draft vocab size {draft_runner.vocab_size} != target vocab size {target_runner.vocab_size}"
                )
            prop = DraftModelProposer(draft_runner, name=str(draft))
        else:
            prop = NgramProposer(max_n=ngram_max_n)
        return cls(target_runner, tokenizer, prop, max_batch_size=max_batch_size)

    def calibrate(
        self, batches=(1, 2, 4, 8, 16, 32), qs=(1, 2, 3, 5, 9), context_len: int = 64, steps: int = 6,
        temperature: float = 0.0, long_context_len: int | None = None,
    ) -> StepCosts:
        """Measure step costs on this hardware through the engine's own code paths (seconds).

        For each batch b and verify width q = K+1, b requests decode with fixed K on a periodic
        prompt (so every proposer proposes all K tokens): t_T(b, q) is the verify phase of a step
        (target forward + sampling + bookkeeping), t_D(b) the propose phase per draft token. The
        framework overhead is thereby inside the costs, as it is inside real steps. With
        ``temperature`` > 0 the steps take the sampling path (draft distributions, the rejection
        sampler), which costs more per step than greedy argmaxes. With ``long_context_len`` the
        batch-1 steps are timed again at that context, which gives the per-token context slopes
        (``StepCosts.at_context``). The engine must be idle.
        """
        if self.has_work():
            raise RuntimeError("calibrate needs an idle engine")
        batches = [b for b in batches if b <= min(self.max_batch_size, self.target.num_free_slots)]
        speculative = self.proposer is not None and max(qs) > 1
        draft_phase = {}  # batch -> [(K, seconds of the step's draft phase)]

        def time_target(b: int, q: int) -> float:
            verify, propose = self._time_steps(b, q - 1, context_len, steps, temperature)
            if q > 1:
                draft_phase.setdefault(b, []).append((q - 1, propose))
            return verify

        @functools.cache
        def draft_fit(b: int) -> tuple[float, float]:  # (per token, per step): one fit per batch
            return fit_draft_cost(draft_phase[b])

        time_draft = (lambda b: draft_fit(b)[0]) if speculative else None
        time_draft_step = (lambda b: draft_fit(b)[1]) if speculative else None
        proposer = self.proposer
        if speculative and not proposer.proposes_full_k:
            # A lookup finds no match in the synthetic prompt's continuation and would propose
            # nothing, so the "K+1" verifies would be plain steps: time full-width verifies instead.
            self.proposer = _FullWidthProposer()
        try:
            costs = calibrate(time_target, time_draft, batches=batches, qs=qs,  # target first: draft_phase filled
                              time_draft_step=time_draft_step)
            costs = dataclasses.replace(costs, context_len=context_len)
            long_context_len = min(long_context_len or 0, self.max_model_len - (steps + 3) * max(qs))
            if long_context_len > context_len:
                costs = self._context_slopes(costs, qs, long_context_len, steps, temperature)
        finally:
            self.proposer = proposer
        runner = getattr(proposer, "runner", None)
        if speculative and runner is not None:
            prefill_tokens = min(256, runner.max_len - 1)
            per_token = runner.time_step(1, prefill_tokens, context_len=1, repeats=2) / prefill_tokens
            costs = dataclasses.replace(costs, draft_prefill_s_per_token=per_token)
        return costs

    def _context_slopes(self, costs: StepCosts, qs, long_context_len: int, steps: int, temperature: float
                        ) -> StepCosts:
        extra = long_context_len - costs.context_len
        slopes, draft_slopes = [], []
        for q in qs:
            verify, propose = self._time_steps(1, q - 1, long_context_len, steps, temperature)
            slopes.append(max(0.0, verify - costs.target_time(1, q)) / extra)
            if q > 1 and self.proposer is not None:
                per_token = (propose - costs.draft_step_time(1)) / (q - 1)
                draft_slopes.append(max(0.0, per_token - costs.draft_time(1)) / extra)
        return dataclasses.replace(
            costs, context_slope_s=tuple(slopes),
            draft_context_slope_s=statistics.median(draft_slopes) if draft_slopes else 0.0,
        )

    def _time_steps(self, batch: int, k: int, context_len: int, steps: int, temperature: float = 0.0
                    ) -> tuple[float, float]:
        """Median (verify seconds, propose seconds) of ``steps`` decode steps at this batch and K."""
        params = SamplingParams(max_new_tokens=(steps + 3) * (k + 1), temperature=temperature, seed=0,
                                ignore_eos=True, num_speculative_tokens=k)
        context_len = min(context_len, self.max_model_len - params.max_new_tokens)
        period = [(7 * i + 3) % self.target.vocab_size for i in range(7)]
        prompt = (period * (context_len // 7 + 1))[:context_len]
        ids = [self.add_request(prompt, params) for _ in range(batch)]
        verify, propose = [], []
        try:
            self.step()  # prefill
            self.step()  # the draft's catch-up on the prompt
            for _ in range(steps):
                self.step()
                verify.append(self.last_step.verify_s)
                propose.append(self.last_step.propose_s)
        finally:
            for rid in ids:
                self.abort(rid)
            self.step()
        return statistics.median(verify), statistics.median(propose)

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
            costs = self.calibrate(long_context_len=long)
            sampled_costs = sampled_costs or self.calibrate(temperature=1.0, long_context_len=long)
        self.adaptive = AdaptiveK(
            CostModel(costs), tracker or AcceptanceTracker(), self.proposer.name, topology,
            sampled_cost_model=CostModel(sampled_costs) if sampled_costs else None,
        )
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
                # A resumed request draws from a stream of its own, derived from (seed, tokens so far):
                # reusing the seed's stream would replay the uniforms that produced its output so far.
                generator.manual_seed(params.seed if resume is None else hash((params.seed, len(resume[0]))) % 2**63)
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
            ks = self._unless_batch_loses(rows, ks)
        catch_up = max(r.draft_catch_up for r in rows)
        t = time.perf_counter()
        proposals = self._propose(rows, ks)
        timing.propose_s = time.perf_counter() - t
        t = time.perf_counter()
        self._verify_and_commit(rows, proposals)
        timing.verify_s = time.perf_counter() - t
        timing.batch = batch
        timing.speculative_rows = sum(1 for p in proposals if p.token_ids)
        # Steps whose rows all proposed K tokens teach adaptive K how far real steps run from the
        # calibration; a draft's catch-up prefill (after plain steps) is not a step cost: skipped.
        proposed = {len(p.token_ids) for p in proposals}
        if self.adaptive is not None and len(proposed) == 1 and (proposed == {0} or catch_up <= 2):
            self.adaptive.observe_step(self._traffic_class(rows[0]), max(len(r.tokens) for r in rows), batch,
                                       proposed.pop(), timing.propose_s + timing.verify_s)

    def _choose_k(self, req: _Request, batch: int) -> int:
        if req.draft_failed or self.proposer is None:
            return 0
        k = req.params.num_speculative_tokens
        if req.params.adaptive_k and self.adaptive is not None and k > 0:
            req.k_state = self.adaptive.choose(
                req.k_state, self._traffic_class(req), req.stats.accepted, sum(req.stats.proposed_per_position),
                batch, k, remaining_tokens=req.params.max_new_tokens - len(req.output_ids),
                catch_up_tokens=req.draft_catch_up, context_len=len(req.tokens),
            )
            k = req.k_state.k
        return req.budget_k(k, self.max_model_len)

    def _unless_batch_loses(self, rows: list[_Request], ks: list[int]) -> list[int]:
        """Adaptive rows speculate this step only if the whole (padded) batch gains from it."""
        adaptive = {i for i, r in enumerate(rows) if r.params.adaptive_k and ks[i] > 0}
        if not adaptive:
            return ks
        classes = [self._traffic_class(r) for r in rows]
        acceptances = [
            self.adaptive.acceptance(cls, r.stats.accepted, sum(r.stats.proposed_per_position))
            for cls, r in zip(classes, rows)
        ]
        context = max(len(r.tokens) for r in rows)
        model = self.adaptive.cost_model_for(classes[min(adaptive)], context)
        if self.adaptive.batch_pays(model, ks, acceptances):
            return ks
        return [0 if i in adaptive else k for i, k in enumerate(ks)]

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
        for queue in (self._waiting,):
            for req in [r for r in queue if r.request_id in aborts]:
                queue.remove(req)
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
    ) -> list[RequestOutput]:
        """Run prompts to completion, batched. Request i is seeded with ``seed + i``; ``params`` (one
        per prompt) overrides the scalar arguments, e.g. to mix plain and speculative requests.
        ``mode="auto"`` re-chooses K each step up to ``num_speculative_tokens`` (``enable_adaptive``
        first), dropping to plain steps where speculation does not pay."""
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
        return [done[i] for i in ids]


class _FullWidthProposer:
    """Calibration stand-in for a proposer that may propose fewer than K tokens: exactly K copies
    of the last token, at ~0 cost (like a lookup's). Verify cost does not depend on which tokens
    are proposed."""

    name = "calibration"
    proposes_full_k = True

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return [Proposal([r.token_ids[-1]] * r.k, None) for r in requests]

    def release(self, seq_id: str) -> None:
        return None

    def num_sequences(self) -> int:
        return 0


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Speculation compares token ids, so draft and target must share one vocabulary."""
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(
            f"draft {draft_name!r} and target {target_name!r} have different tokenizers "
            f"({len(draft_tok)} vs {len(target_tok)} tokens); speculative decoding needs a shared vocabulary"
        )

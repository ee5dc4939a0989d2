"""The in-process engine: continuous batching of plain and speculative requests.

``Engine.step`` is schedule -> execute -> commit (as vLLM's ``EngineCore.step``): the
``Scheduler`` (``scheduler.py``, shared with the separate topology's loop) admits requests,
takes aborts and chooses each row's K (K=0 is plain decoding); the ``LocalExecutor``
(``executor.py``) prefills the admitted rows, drafts K tokens for the speculative ones and
verifies every row in one batched target pass (Leviathan et al. 2023, Algorithm 1: q the
draft's distribution, p the target's); the scheduler commits the accepted, recovered and bonus
tokens. Requests join and leave only at step boundaries.

The scheduler owns each request's authoritative token history; the proposer and verifier hold KV
caches as soft state keyed by request id and reconcile against that history on every call.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import torch

from specdec_core.acceptance import AcceptanceTracker
from specdec_core.adaptive import AdaptiveK
from specdec_core.cost_view import CostView
from specdec_core.executor import LocalExecutor
from specdec_core.kv_cache import KVWindow
from specdec_core.loading import load_models
from specdec_core.proposers import Proposer
from specdec_core.request import RequestOutput, SamplingParams, eos_token_ids, resumed_seed
from specdec_core.runner import ModelRunner
from specdec_core.scheduler import ScheduledRequest, Scheduler, StepPlan
from specdec_core.stats import StepTiming
from specdec_core.step_costs import StepCosts
from specdec_core.verifier import Verifier

logger = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        target: ModelRunner,
        tokenizer,
        proposer: Proposer | None = None,
        max_batch_size: int = 32,
        adaptive: AdaptiveK | None = None,
        verifier: Verifier | None = None,
    ):
        self.target = target
        self.tokenizer = tokenizer
        self.executor = LocalExecutor(verifier or Verifier(target), proposer)
        self.max_model_len = target.max_len
        self.scheduler = Scheduler(min(max_batch_size, target.num_slots), self.max_model_len, proposer is not None,
                                   adaptive)
        self.eos_token_ids = eos_token_ids(tokenizer, target.model.generation_config)
        self.last_step = StepTiming()
        self._ids = itertools.count()

    def sibling(self, proposer: Proposer) -> Engine:
        """An engine over the same target and verifier with another proposer (this one idle meanwhile)."""
        return Engine(self.target, self.tokenizer, proposer, self.max_batch_size, verifier=self.verifier)

    @property
    def proposer(self) -> Proposer | None:
        return self.executor.proposer

    @property
    def verifier(self) -> Verifier:
        return self.executor.verifier

    @property
    def adaptive(self) -> AdaptiveK | None:
        return self.scheduler.adaptive

    @property
    def max_batch_size(self) -> int:
        return self.scheduler.max_batch_size

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, target: str, draft: str | None = None, proposer: str | None = None, *, device: str | None = None,
        dtype: str | torch.dtype | None = None, max_batch_size: int = 32, max_model_len: int = 1024,
        trust_remote_code: bool = False, ngram_max_n: int = 4, draft_kv_window: KVWindow | None = None,
        prefix_cache_tokens: int = 0,
    ) -> Engine:
        """Load a target and its proposer from local paths or hub names (``loading.load_models``):
        ``proposer`` is "draft" (needs ``draft``) or "ngram", by default "draft" when a draft is given;
        ``prefix_cache_tokens`` > 0 turns on automatic prefix caching (``prefix_cache.py``) for each model."""
        target_runner, tokenizer, prop = load_models(
            target, draft, proposer, device=device, dtype=dtype, max_slots=max_batch_size,
            max_len=max_model_len, trust_remote_code=trust_remote_code, ngram_max_n=ngram_max_n,
            draft_kv_window=draft_kv_window, prefix_cache_tokens=prefix_cache_tokens,
        )
        return cls(target_runner, tokenizer, prop, max_batch_size=max_batch_size)

    def enable_adaptive(
        self, costs: StepCosts, tracker: AcceptanceTracker | None = None, topology: str = "colocated",
        sampled_costs: StepCosts | None = None, budgeted: bool = False,
    ) -> AdaptiveK:
        """Turn on per-step adaptive K for requests with ``adaptive_k=True``, priced with ``costs``
        (``calibration.calibrate``); sampled requests with ``sampled_costs``, or ``costs`` without.
        ``budgeted``: one plan per step chooses every such row's K for the batch (``step_planner.py``)."""
        if self.proposer is None:
            raise ValueError("adaptive K needs a proposer")
        self.scheduler.adaptive = AdaptiveK(CostView(costs, sampled_costs), tracker or AcceptanceTracker(),
                                            self.proposer.name, topology, budgeted=budgeted)
        return self.scheduler.adaptive

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
        req = ScheduledRequest(request_id or f"req-{next(self._ids)}", prompt_ids, params, self.tokenizer,
                               self.eos_token_ids, generator)
        if resume is not None:
            req.resume(*resume)
        self.scheduler.add(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request finishes with reason "abort" and frees its slots at the next step."""
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- the step ----------------------------------------------------------------------------

    def step(self, stream_text: bool = True) -> list[RequestOutput]:
        """Run one engine step. ``stream_text=False`` skips per-step detokenization (the text is
        then only set on a request's final output), for callers that only want finished results."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(self.executor.free_slots, self.executor.slot_of)
        for req in plan.aborted:
            self.executor.release(req.request_id)
        try:
            result = self.executor.execute(plan)
        except Exception:
            logger.exception("engine step failed; retrying its %d request(s) one at a time", len(plan.rows))
            return self._isolate_failure(plan, stream_text)
        result.timing.total_s = time.perf_counter() - t0
        self.last_step = result.timing
        outputs = self.scheduler.commit(plan, result, stream_text)
        self._release_finished(plan)
        return outputs

    def _isolate_failure(self, plan: StepPlan, stream_text: bool) -> list[RequestOutput]:
        """A failed step fails only the requests that fail alone: each is retried as a step of its
        own. Retrying is safe because the caches reconcile against each request's history
        (``SequenceSlots.sync``): nothing of the failed step was committed."""
        outputs = [r.output(stream_text) for r in plan.aborted]
        for req in plan.rows:
            alone = plan.only(req)
            try:
                outputs += self.scheduler.commit(alone, self.executor.execute(alone), stream_text)
            except Exception as exc:
                logger.exception("request %s fails a step on its own; it ends with an error", req.request_id)
                self.scheduler.fail(req, exc)
                outputs.append(req.output(stream_text))
        self.last_step = StepTiming()
        self._release_finished(plan)
        return outputs

    def _release_finished(self, plan: StepPlan) -> None:
        for req in plan.rows:
            if req.finished:
                self.executor.release(req.request_id)

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


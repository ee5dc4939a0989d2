"""EngineReplica: one ``specdec_core.AsyncEngine`` per replica, continuous batching in-process.

Configured with a draft it is the co-located speculative pool (draft and target share the process
and every step's batch); without one it is the plain pool. The same class is deployed twice under
different names (see app.py). The engine owns each request's history; this class only translates
between the router's messages (``deployments/messages.py``) and the engine, and reports load.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import torch
from ray import serve

from deployments.calibrate import DEFAULT_BATCHES, DEFAULT_QS, cache_key, cached, device_kind, load_calibration, store
from deployments.config import AppConfig, model_label
from deployments.messages import Delta, EngineStats, GenerateRequest, ReplicaCosts
from deployments.metrics import log_request
from specdec_core import AsyncEngine, Engine
from specdec_core.acceptance import AcceptanceTracker
from specdec_core.async_engine import coalesced
from specdec_core.calibration import calibrate

logger = logging.getLogger("ray.serve")


class EngineReplica:
    def __init__(self, config: dict, speculative: bool, pool: str):
        cfg = AppConfig(**config)
        torch.set_num_threads(cfg.torch_threads)
        self.pool = pool
        self.speculative = speculative
        engine = Engine.from_pretrained(
            target=cfg.target,
            draft=cfg.draft if speculative else None,
            proposer="draft" if speculative else None,
            device=cfg.device,
            dtype=cfg.dtype,
            max_batch_size=cfg.max_batch_size,
            max_model_len=cfg.max_model_len,
            trust_remote_code=cfg.trust_remote_code,
            draft_kv_window=cfg.draft_window,
            prefix_cache_tokens=cfg.prefix_cache_tokens,
        )
        self._costs, self._costs_source, self._sampled_costs = None, None, None
        if speculative:
            self._calibrate(engine, cfg)
        self.engine = AsyncEngine(engine)
        self._served = 0
        self._aborted = 0
        logger.info("EngineReplica(%s) ready: target=%s draft=%s slots=%d max_len=%d", pool, cfg.target,
                    cfg.draft if speculative else None, engine.target.num_slots, engine.max_model_len)

    def _calibrate(self, engine: Engine, cfg: AppConfig) -> None:
        """Step costs from the calibration file (matching pair and device) or measured now, then
        adaptive K: requests with ``adaptive_k`` re-choose K <= their K every step from them."""
        device = device_kind(engine.target.device)
        t0 = time.perf_counter()
        sampled = None  # a calibration file holds greedy costs; sampled requests are then priced by them
        if cfg.calibration_file:
            self._costs = load_calibration(cfg.calibration_file, cfg.target, cfg.draft, device)
            self._costs_source = f"file:{model_label(cfg.calibration_file)}" if self._costs else None
        if self._costs is None and cfg.calibrate_on_start:
            batches = tuple(b for b in DEFAULT_BATCHES if b <= cfg.max_batch_size)
            qs = tuple(q for q in DEFAULT_QS if q <= cfg.k_max + 1)
            grid = {"batches": batches, "qs": qs, "long_context_len": cfg.max_model_len // 2}
            key = cache_key(cfg.target, cfg.draft, device, cfg.dtype, draft_window=repr(cfg.draft_window), **grid)
            hit = cached(key) if cfg.calibration_cache else None
            if hit is not None:
                (self._costs, sampled), self._costs_source = hit, f"cached:{device}"
            else:
                self._costs = calibrate(engine, **grid)
                sampled = calibrate(engine, **grid, temperature=1.0)
                self._costs_source = f"calibrated:{device}"
                if cfg.calibration_cache:
                    store(key, self._costs, sampled)
        if self._costs is None:
            logger.warning("EngineReplica(%s): no step costs; adaptive K off", self.pool)
            return
        tracker = AcceptanceTracker(cfg.acceptance_prior, cfg.acceptance_prior_weight,
                                    cfg.acceptance_half_life_tokens)
        self._sampled_costs = sampled
        engine.enable_adaptive(self._costs, tracker, sampled_costs=sampled, budgeted=cfg.budgeted_verification)
        logger.info("EngineReplica(%s): step costs %s in %.1f s (t_T(1,1)=%.2f ms, t_D(1)=%.2f ms)", self.pool,
                    self._costs_source, time.perf_counter() - t0, self._costs.target_time(1, 1) * 1e3,
                    self._costs.draft_time(1) * 1e3)

    async def costs(self) -> ReplicaCosts | None:
        """The replica's step costs (greedy, and sampled when calibrated) and their source; None without."""
        if self._costs is None:
            return None
        return ReplicaCosts(self._costs, self._sampled_costs, self._costs_source)

    def record_autoscaling_stats(self) -> dict:
        """Serve calls this on each replica; `active_sequences` is the autoscaling policy's `metric`."""
        e = self.engine.engine
        return {"active_sequences": float(e.num_running + e.num_waiting)}

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        """Stream one request (call with ``handle.options(stream=True)``). With ``adaptive_k``
        (mode=auto) the engine re-chooses K <= num_speculative_tokens every step. Steps are
        coalesced into one delta per ``stream_interval_s`` (the first and the last go out at once);
        without it the whole output is one delta. Leaving early (caller cancels, client gone)
        aborts the request inside the engine and frees its slots."""
        t0 = time.perf_counter()
        last = None
        resume = (list(req.resume.output_ids), req.resume.sent_chars) if req.resume else None
        if req.drift is not None and self.engine.engine.adaptive is not None:
            self.engine.engine.adaptive.adopt_drift(req.drift)  # the router's view of served steps
        stream = self.engine.stream(req.prompt_ids, req.params, req.request_id, resume)
        try:
            async for out in coalesced(stream, req.stream_interval_s):
                last = out
                yield Delta.of(out)
        finally:
            try:
                await stream.aclose()  # early exit: aborts the request in the engine, frees its slots
            finally:
                self._log(req, last, time.perf_counter() - t0)

    def _log(self, req: GenerateRequest, last, latency_s: float) -> None:
        self._served += 1
        finished = last is not None and last.finished
        if not finished:
            self._aborted += 1
        log_request(logger, req.request_id, self.pool, req.params.num_speculative_tokens, "colocated",
                    len(req.prompt_ids), last.stats if last is not None else None, latency_s,
                    last.finish_reason if finished else "abort")

    async def stats(self) -> EngineStats:
        """Load and state: what the router and the tests read."""
        e = self.engine.engine
        draft_sessions = e.proposer.num_sequences() if e.proposer is not None else 0
        return EngineStats(
            pool=self.pool, replica=serve.get_replica_context().replica_id.unique_id, running=e.num_running,
            waiting=e.num_waiting, free_slots=e.target.num_free_slots, total_slots=e.target.num_slots,
            target_sessions=len(e.verifier.slots), draft_sessions=draft_sessions,
            draft_free_slots=e.proposer.runner.num_free_slots if hasattr(e.proposer, "runner") else None,
            streams=len(self.engine._streams), served=self._served, aborted=self._aborted,
            adaptive=e.adaptive is not None, costs_source=self._costs_source,
            drift={b: dataclasses.asdict(d) for b, d in e.adaptive.view.drift.buckets.items()} if e.adaptive else {},
            prefix_cache={name: runner.prefix_cache.stats() for name, runner in
                          (("target", e.target), ("draft", getattr(e.proposer, "runner", None)))
                          if runner is not None and runner.prefix_cache is not None},
        )

    def check_health(self) -> None:
        if not self.engine._thread.is_alive():
            raise RuntimeError("engine loop thread died")

    def __del__(self):
        try:
            self.engine.shutdown()
        except Exception:
            logger.debug("engine shutdown failed", exc_info=True)

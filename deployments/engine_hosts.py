"""Where an engine replica's engine runs: in a process of its own (``EngineProcess``,
``deployments/engine_process.py``, the default) or on a thread of the replica (``EngineThread``,
``engine_process: false``). Both build the engine the same way (``build_engine``: the models, and for
the co-located pool the step costs adaptive K prices with) and answer the replica the same way:
``stream(GenerateRequest)`` yields one ``Delta`` per engine step, ``fields()`` the engine's state for
``EngineStats``, ``load()`` its running and waiting sequences, ``alive()``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import torch

from deployments.calibrate import (
    DEFAULT_BATCHES,
    DEFAULT_QS,
    cache_key,
    cached,
    device_kind,
    load_calibration,
    measuring_alone,
    store,
)
from deployments.config import AppConfig, model_label
from deployments.messages import Delta, GenerateRequest, ReplicaCosts
from specdec_core import AsyncEngine, Engine
from specdec_core.acceptance import AcceptanceTracker
from specdec_core.calibration import calibrate

logger = logging.getLogger("ray.serve")


def build_engine(cfg: AppConfig, speculative: bool, pool: str) -> tuple[Engine, ReplicaCosts | None]:
    """The replica's engine, and for a speculative one the step costs its adaptive K prices with."""
    torch.set_num_threads(cfg.torch_threads)
    with measuring_alone():  # the kernel probes and the calibration time this host: one replica at a time
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
        costs = _calibrate(engine, cfg, pool) if speculative else None
    logger.info("engine (%s) ready: target=%s draft=%s slots=%d max_len=%d", pool, cfg.target,
                cfg.draft if speculative else None, engine.target.num_slots, engine.max_model_len)
    return engine, costs


def _calibrate(engine: Engine, cfg: AppConfig, pool: str) -> ReplicaCosts | None:
    """Step costs from the calibration file (matching pair and device) or measured now, then
    adaptive K: requests with ``adaptive_k`` re-choose K <= their K every step from them."""
    device = device_kind(engine.target.device)
    t0 = time.perf_counter()
    costs, sampled, source = None, None, None  # a calibration file holds greedy costs; they price sampling too
    if cfg.calibration_file:
        costs = load_calibration(cfg.calibration_file, cfg.target, cfg.draft, device)
        source = f"file:{model_label(cfg.calibration_file)}" if costs else None
    if costs is None and cfg.calibrate_on_start:
        batches = tuple(b for b in DEFAULT_BATCHES if b <= cfg.max_batch_size)
        qs = tuple(q for q in DEFAULT_QS if q <= cfg.k_max + 1)
        grid = {"batches": batches, "qs": qs, "long_context_len": cfg.max_model_len // 2}
        key = cache_key(cfg.target, cfg.draft, device, cfg.dtype, draft_window=repr(cfg.draft_window), **grid)
        hit = cached(key) if cfg.calibration_cache else None
        if hit is not None:
            (costs, sampled), source = hit, f"cached:{device}"
        else:
            costs = calibrate(engine, **grid)
            sampled = calibrate(engine, **grid, temperature=1.0)
            source = f"calibrated:{device}"
            if cfg.calibration_cache:
                store(key, costs, sampled)
    if costs is None:
        logger.warning("engine (%s): no step costs; adaptive K off", pool)
        return None
    tracker = AcceptanceTracker(cfg.acceptance_prior, cfg.acceptance_prior_weight, cfg.acceptance_half_life_tokens)
    engine.enable_adaptive(costs, tracker, sampled_costs=sampled, budgeted=cfg.budgeted_verification)
    logger.info("engine (%s): step costs %s in %.1f s (t_T(1,1)=%.2f ms, t_D(1)=%.2f ms)", pool, source,
                time.perf_counter() - t0, costs.target_time(1, 1) * 1e3, costs.draft_time(1) * 1e3)
    return ReplicaCosts(costs, sampled, source)


def submit(engine: Engine, req: GenerateRequest) -> str:
    """Queue the request in ``engine`` (ValueError on input the engine refuses)."""
    adopt_drift(engine, req)
    return engine.add_request(req.prompt_ids, req.params, req.request_id, resume_of(req))


def adopt_drift(engine: Engine, req: GenerateRequest) -> None:
    """An adaptive request brings the router's drift: the engine's adaptive K prices with it from now on."""
    if req.drift is not None and engine.adaptive is not None:
        engine.adaptive.adopt_drift(req.drift)


def resume_of(req: GenerateRequest) -> tuple[list[int], int] | None:
    return (list(req.resume.output_ids), req.resume.sent_chars) if req.resume else None


def engine_fields(engine: Engine) -> dict:
    """The engine's half of ``EngineStats``: load, slots, sessions, adaptive K's drift, prefix caches."""
    draft_runner = getattr(engine.proposer, "runner", None)
    return dict(
        running=engine.num_running, waiting=engine.num_waiting, free_slots=engine.target.num_free_slots,
        total_slots=engine.target.num_slots, target_sessions=len(engine.verifier.slots),
        draft_sessions=engine.proposer.num_sequences() if engine.proposer is not None else 0,
        draft_free_slots=draft_runner.num_free_slots if draft_runner is not None else None,
        adaptive=engine.adaptive is not None,
        drift={b: dataclasses.asdict(d) for b, d in engine.adaptive.view.drift.buckets.items()}
        if engine.adaptive else {},
        prefix_cache={name: runner.prefix_cache.stats() for name, runner in (("target", engine.target),
                                                                               ("draft", draft_runner))
                      if runner is not None and runner.prefix_cache is not None},
    )


class EngineThread:
    """The engine on a thread of the replica's process (``specdec_core.AsyncEngine``): its steps share
    the replica's GIL with the event loop that streams the deltas (BENCHMARKS.md, "The engine in a
    process of its own")."""

    def __init__(self, cfg: AppConfig, speculative: bool, pool: str):
        engine, self.costs = build_engine(cfg, speculative, pool)
        self._async = AsyncEngine(engine)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        adopt_drift(self._async.engine, req)
        stream = self._async.stream(req.prompt_ids, req.params, req.request_id, resume_of(req))
        try:
            async for out in stream:
                yield Delta.of(out)
        finally:
            await stream.aclose()  # early exit: aborts the request in the engine, frees its slots

    async def fields(self) -> dict:
        return engine_fields(self._async.engine)

    def load(self) -> tuple[int, int]:
        return self._async.engine.num_running, self._async.engine.num_waiting

    def alive(self) -> bool:
        return self._async.alive()

    def shutdown(self) -> None:
        self._async.shutdown()

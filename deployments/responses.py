"""OpenAI responses from a request's deltas: one completion body, or the SSE stream.

Every SSE write is a message from the router replica to the proxy, so a stream writes once per
delta: the chat role chunk rides with the first delta; the last chunk, the usage chunk and
``[DONE]`` go out together. Each final chunk carries a ``speculation`` object: what ran (pool,
topology, K, adaptive), what it achieved (proposed / accepted tokens, steps) and why it was
routed there (regime, predicted and realised speedup).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from deployments import schemas
from deployments.api import APIError, internal_error_message, sse_event
from deployments.messages import Delta
from deployments.planning import Execution, unavailable
from deployments.pools import PoolUnavailable
from specdec_core import RequestStats

logger = logging.getLogger("ray.serve")


def speculation(run: Execution, stats: RequestStats, costs_source: str) -> dict:
    plan, d = run.plan, run.plan.decision
    return {
        "mode": "speculative" if stats.proposed else "plain",  # what ran: an adaptive request may run plain
        "routed_mode": "speculative" if d.k > 0 else "plain",
        "topology": d.topology,
        "num_speculative_tokens": d.k,
        "proposed_tokens": stats.proposed,
        "accepted_tokens": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "verify_steps": stats.verify_steps,
        "plain_steps": stats.plain_steps,  # decode steps without draft tokens (adaptive K = 0)
        "plain_steps_by_cause": dict(stats.plain_by_cause),  # an auto request's K=0 decode steps, by what set K to 0
        # draft tokens per decode step: what adaptive K or a budgeted plan gave this request; accepted
        # per proposed is what each bought
        "mean_k": stats.proposed / max(1, stats.decode_steps),
        "pool": run.pool,
        "adaptive_k": plan.params.adaptive_k,
        "probe": plan.probe,
        "regime": d.regime,
        "predicted_speedup": d.predicted_speedup,
        "realised_speedup": run.realised_speedup,
        "batch": plan.batch,  # the batch it joined
        "mean_batch": stats.mean_decode_batch,  # the batch its decode steps ran in, on average
        # the engine's wall time of the decode steps it took part in: its decode time less the other
        # requests' prefills it waited for and the serving layer's share
        "decode_s": stats.decode_s,
        "decode_steps": stats.decode_steps,
        # of its decode time by the clock, the other requests' prefills its engine ran while it decoded
        "prefill_wait_s": stats.prefill_wait_s,
        # from its arrival in the engine to its first token (its prefill, queueing included), by the engine's
        # clock: a client's time to first token less this is what the serving layer added
        "engine_first_token_s": stats.first_token_s,
        "route_reason": d.reason,
        "costs_source": costs_source,
        "migrations": run.migrations,
    }


async def complete(run: Execution, deltas: AsyncIterator[Delta], costs_source: str) -> dict:
    """The whole response as one body. Errors while it runs become ``APIError`` (500, or 503 with
    ``Retry-After`` when no replica could finish it) without internals."""
    plan = run.plan
    text, token_ids, last = [], [], None
    try:
        async for d in deltas:
            text.append(d.text)
            token_ids.extend(d.token_ids)
            last = d
    except APIError:
        raise
    except PoolUnavailable:
        logger.exception("request %s: no replica could finish it", plan.request_id)
        raise unavailable(plan.request_id) from None
    except Exception:
        logger.exception("request %s failed", plan.request_id)
        raise APIError(500, internal_error_message(plan.request_id), "server_error") from None
    finally:
        await deltas.aclose()
    stats = last.stats if last and last.stats else RequestStats()
    build = schemas.chat_body if plan.chat else schemas.completion_body
    return build(plan.request_id, schemas.now(), plan.model, "".join(text), last.finish_reason if last else None,
                 schemas.usage(len(plan.prompt_ids), len(token_ids)), speculation(run, stats, costs_source),
                 token_ids if plan.return_token_ids else None)


async def stream(run: Execution, deltas: AsyncIterator[Delta], costs_source: str, on_end: Callable[[], None]
                 ) -> AsyncIterator[str]:
    """SSE events, one write per delta; a failure mid-stream ends it with an error event and
    ``[DONE]``, so a client can tell it from a complete stream. ``on_end`` runs first when the
    stream ends (the awaited close after it can be interrupted by a second cancellation)."""
    plan = run.plan
    created = schemas.now()
    n_out, done = 0, False
    pending = [sse_event(schemas.chat_chunk(plan.request_id, created, plan.model,
                                            {"role": "assistant", "content": ""}))] if plan.chat else []
    try:
        async for d in deltas:
            n_out += len(d.token_ids)
            events, pending = pending + _delta_events(run, d, created, n_out, costs_source), []
            if d.finished:
                events.append("data: [DONE]\n\n")
                done = True
            if events:
                yield "".join(events)
        if not done:
            yield "".join(pending) + "data: [DONE]\n\n"
    except Exception:
        logger.exception("stream %s failed", plan.request_id)
        yield (sse_event(schemas.error_body(internal_error_message(plan.request_id), "server_error"))
               + "data: [DONE]\n\n")
    finally:
        on_end()
        await deltas.aclose()


def _delta_events(run: Execution, d: Delta, created: int, n_out: int, costs_source: str) -> list[str]:
    plan = run.plan
    rid, model = plan.request_id, plan.model
    ids = d.token_ids if plan.return_token_ids else None
    if not d.finished:
        if not (d.text or d.token_ids):
            return []
        if plan.chat:
            return [sse_event(schemas.chat_chunk(rid, created, model, {"content": d.text}, None, ids))]
        return [sse_event(schemas.completion_chunk(rid, created, model, d.text, None, ids))]
    spec = speculation(run, d.stats or RequestStats(), costs_source)
    if plan.chat:
        chunk = schemas.chat_chunk(rid, created, model, {"content": d.text} if d.text else {}, d.finish_reason, ids)
    else:
        chunk = schemas.completion_chunk(rid, created, model, d.text, d.finish_reason, ids)
    chunk["speculation"] = spec
    events = [sse_event(chunk)]
    if plan.include_usage:
        events.append(sse_event({"id": rid, "object": chunk["object"], "created": created, "model": model,
                                 "choices": [], "usage": schemas.usage(len(plan.prompt_ids), n_out),
                                 "speculation": spec}))
    return events

"""Request planning: an OpenAI request -> the prompt's token ids and a ``Plan`` (where it runs,
with which K and sampling settings, and why), or a 4xx ``APIError`` before any model work.

``Prompts`` owns the target's tokenizer and limits. Tokenization runs off the router's event loop,
on one thread: a fast tokenizer must not be used from two threads at once ("Already borrowed").
Chat fallback template (tokenizers without ``chat_template``): every message is rendered as
``"<role>: <content>\\n"`` and the prompt ends with ``"assistant:"``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from autoscaling.routing import Pool, PoolLoad, RoutingDecision, RoutingError
from deployments import schemas
from deployments.api import APIError, bad_request
from deployments.config import AppConfig
from deployments.route_state import Route, RouteState, objective_of
from specdec_core import SamplingParams
from specdec_core.acceptance import TrafficClass
from specdec_core.request import eos_token_ids

RETRY_AFTER_S = 15  # a 503 for lost replicas: Serve restarts a replica in ~13-17 s here


@dataclass(frozen=True)
class Plan:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # validated and normalized; K = the routed K (0: plain)
    decision: RoutingDecision
    model: str
    chat: bool
    return_token_ids: bool
    include_usage: bool
    traffic_class: TrafficClass
    pool: Pool = Pool.PLAIN  # the deployed pool it was routed to (decision.pool, or a spec pool for plain decoding)
    batch: int = 1  # per-replica batch it joined
    requested_mode: str = "auto"
    stream: bool = False  # the client streams: the replica sends tokens as they come, else one message
    probe: bool = False  # an exploration probe of a class that goes plain for its acceptance

    def params_for(self, pool: str) -> SamplingParams:
        """The settings a pool runs this request with: the plain pool has no draft (K=0)."""
        if pool == Pool.PLAIN:
            return dataclasses.replace(self.params, num_speculative_tokens=0, adaptive_k=False)
        return self.params


@dataclass
class Execution:
    """How a planned request runs: the pool it is in (a migrated request moves) and what it achieved."""

    plan: Plan
    pool: Pool
    migrations: int = 0  # times the request moved because the replica serving it died
    realised_speedup: float | None = None
    counted: bool = False  # in its pool's load: from ``Pools.generate`` to its last delta (``Pools.release``)

    @classmethod
    def of(cls, plan: Plan) -> Execution:
        return cls(plan, plan.pool)


# Texts up to this many characters are tokenized on the event loop (~0.2 ms here), longer ones on the
# tokenizer thread: the hop there and back costs 0.4-0.8 ms of time to first token on 2 vCPUs
# (BENCHMARKS.md, "Time to first token, hop by hop"), more than a short prompt's tokenization.
INLINE_TOKENIZE_CHARS = 1024


class Prompts:
    """The target's tokenizer, vocabulary, context limit and EOS ids."""

    def __init__(self, cfg: AppConfig):
        from transformers import AutoConfig, GenerationConfig

        from specdec_core.runner import load_tokenizer

        self.tokenizer = load_tokenizer(cfg.target, cfg.trust_remote_code)
        model_cfg = AutoConfig.from_pretrained(cfg.target, trust_remote_code=cfg.trust_remote_code)
        self.vocab_size = int(model_cfg.vocab_size)
        self.max_model_len = min(cfg.max_model_len,
                                 getattr(model_cfg, "max_position_embeddings", None) or cfg.max_model_len)
        try:
            gen_cfg = GenerationConfig.from_pretrained(cfg.target)
        except Exception:  # noqa: BLE001 - checkpoints without generation_config.json
            gen_cfg = None
        self.eos_ids = eos_token_ids(self.tokenizer, gen_cfg)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def completion_ids(self, prompt) -> list[int]:
        """A completion request's prompt (text, token ids, or a list of one of those) -> token ids."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self._tokenized(self._encode, prompt, len(prompt))
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise bad_request(f"prompt token ids must lie in [0, {self.vocab_size})", "prompt", "invalid_token_id")
        return ids

    async def chat_ids(self, messages: list[dict]) -> list[int]:
        return await self._tokenized(self._encode_chat, messages, sum(len(m["content"]) for m in messages))

    async def _tokenized(self, fn, arg, chars: int):
        if chars <= INLINE_TOKENIZE_CHARS:
            return fn(arg)
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, arg)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        # The fallback has no special tokens of its own: text that spells one (an "<|endoftext|>" in a
        # message) stays text, so a message cannot end the document or forge a separator.
        return list(self.tokenizer(text, split_special_tokens=True)["input_ids"])


def check_supported(body) -> None:
    """OpenAI fields this server refuses (400) before any work."""
    field = body.unsupported_field()
    if field is not None:
        raise bad_request(f"{field} is not supported by this server", field, "unsupported_parameter")
    if body.n != 1:
        raise bad_request("only n=1 is supported", "n")


def unavailable(request_id: str) -> APIError:
    return APIError(503, f"no model replica can serve the request now (request id {request_id}); retry later",
                    "server_error", None, "unavailable", {"Retry-After": str(RETRY_AFTER_S)})


def _plain_while_down(route_state: RouteState, features, loads: Mapping[str, PoolLoad], down: Collection[str],
                      request_id: str) -> Route:
    """Speculation asked for in a pool that lost its replica (restarting): plain decoding on a pool that is
    up, as that pool's in-flight requests migrate. Speculation is lossless, so the output is the same
    (greedy token for token, sampled from the same distribution): only the speed differs, and the
    response says what ran. 503 with Retry-After only when no pool can take it."""
    try:
        route = route_state.decide(dataclasses.replace(features, mode="plain", k=0, topology=None), loads)
    except RoutingError:
        raise unavailable(request_id) from None
    reason = f"{' and '.join(sorted(down))} down (restarting): plain decoding until it is back"
    return dataclasses.replace(route, decision=dataclasses.replace(route.decision, reason=reason))


def plan_request(body, ids: list[int], max_tokens: int | None, default_max: int, chat: bool, request_id: str,
                 cfg: AppConfig, prompts: Prompts, route_state: RouteState, loads: Mapping[str, PoolLoad],
                 unavailable_pools: Collection[str] = ()) -> Plan:
    """Check the request against the model's limits, route it (``RouteState.decide``, over the
    pools that can take it now) and fix its sampling settings. Raises ``APIError``: 4xx, or 503
    with ``Retry-After`` when no pool that is up can take it."""
    field_ = "messages" if chat else "prompt"
    if body.model is not None and body.model != cfg.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {cfg.model_name!r}",
                       "invalid_request_error", "model", "model_not_found")
    if not ids:
        raise bad_request("the prompt is empty", field_)
    stops = body.stop_list()
    if len(stops) > 4:
        raise bad_request("at most 4 stop sequences", "stop")
    limit = prompts.max_model_len
    if len(ids) >= limit:
        raise APIError(413, f"the prompt has {len(ids)} tokens; the context limit is {limit} tokens "
                            f"(prompt + at least one output token)", "invalid_request_error", field_,
                       "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(default_max, limit - len(ids))
    elif len(ids) + max_tokens > limit:
        raise bad_request(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context limit "
                          f"of {limit} tokens", "max_tokens", "context_length_exceeded")
    spec = body.speculation or schemas.SpeculationOptions()
    cls = route_state.traffic_class(body.temperature, body.user)
    features = route_state.features(
        temperature=body.temperature, top_p=body.top_p, max_tokens=max_tokens, prompt_tokens=len(ids),
        mode=spec.mode, k=spec.num_speculative_tokens, topology=spec.topology,
        objective=objective_of(spec.objective, body.service_tier), cls=cls)
    if not loads:
        raise unavailable(request_id)
    try:
        route = route_state.decide(features, loads)
    except RoutingError as exc:
        if not (unavailable_pools and (spec.topology in unavailable_pools or spec.mode == "speculative")):
            raise bad_request(str(exc), "speculation") from None
        route = _plain_while_down(route_state, features, loads, unavailable_pools, request_id)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k, seed=body.seed, stop=tuple(stops), ignore_eos=body.ignore_eos,
                            num_speculative_tokens=route.decision.k, adaptive_k=route.adaptive,
                            domain=cls.domain,
                            # the router's estimate: the replica's adaptive K, or the separate loop's
                            # choice to overlap, prices the request with it
                            class_acceptance=(route_state.tracker.estimate(cls)
                                              if route.adaptive or route.pool == Pool.SEPARATE else None))
    try:
        params.validate()  # the engine's own admission check, so no request reaches a step it would fail
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return Plan(f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", ids, params.normalized(prompts.vocab_size),
                route.decision, cfg.model_name, chat, body.return_token_ids,
                bool(body.stream_options and body.stream_options.include_usage), cls, pool=route.pool,
                batch=route.batch, requested_mode=spec.mode, stream=body.stream, probe=route.probe)

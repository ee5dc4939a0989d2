"""OpenAI-compatible request models (completions, chat completions) plus the ``speculation``
extension, and builders for the response / stream-chunk bodies.

Supported: n=1, max_tokens, temperature, top_p, seed, stop, stream (+ stream_options.include_usage),
user. Extensions (vLLM-style): top_k, ignore_eos, return_token_ids, and
``speculation: {mode, num_speculative_tokens, topology, objective}``. Unknown fields are ignored, as the
OpenAI API does for fields it does not know; fields we know but do not support (n > 1, best_of > 1,
echo, logprobs) are rejected with 400 by the router.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class SpeculationOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "speculative", "plain"] = Field(
        "auto", description="auto: the router decides; speculative: always speculate; plain: never."
    )
    num_speculative_tokens: int | None = Field(
        None, ge=0, le=16, description="K; null: the router's choice; 0 means plain decoding."
    )
    topology: Literal["colocated", "separate"] | None = Field(
        None, description="Where to speculate: draft and target in one replica, or in two deployments."
    )
    objective: Literal["latency", "throughput"] | None = Field(
        None, description="mode=auto: latency (default) speculates where the cost model says it is faster; "
        "throughput (bulk traffic) decodes plain. Default: throughput when service_tier is flex/batch/scale."
    )


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None  # also the traffic-class domain of the acceptance statistics
    service_tier: str | None = None  # "flex" / "batch" / "scale": throughput objective in mode=auto
    ignore_eos: bool = False
    return_token_ids: bool = False
    speculation: SpeculationOptions | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class CompletionRequest(_GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"unsupported content part type {part.get('type')!r}: only text")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None


# ---- responses ------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid, created, model, text, finish_reason, usage_, speculation, token_ids=None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage_, "speculation": speculation}


def completion_chunk(rid, created, model, text, finish_reason=None, token_ids=None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_body(rid, created, model, text, finish_reason, usage_, speculation, token_ids=None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": usage_, "speculation": speculation}


def chat_chunk(rid, created, model, delta: dict, finish_reason=None, token_ids=None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice]}

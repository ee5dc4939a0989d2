"""OpenAI-compatible request models (completions, chat completions) plus the ``speculation``
extension, and builders for the response / stream-chunk bodies.

Supported: n=1, max_tokens, temperature, top_p, seed, stop, stream (+ stream_options.include_usage),
user. Extensions (vLLM-style): top_k, ignore_eos, return_token_ids, and
``speculation: {mode, num_speculative_tokens, topology, objective}``. Unknown fields are ignored;
OpenAI fields we do not implement (n > 1, best_of > 1, echo, logprobs, logit_bias, suffix,
penalties, tools, ...: ``_UNSUPPORTED_DEFAULTS``) are refused with a 400 naming the field unless
they hold their "unused" value. Text must be valid Unicode; stop strings are non-empty.

Types are strict (pydantic strict mode), as OpenAI's API reads them: an integer field takes a JSON
integer only, a boolean a JSON boolean only, a float field a number (an integer too), never a bool or
a string that looks like a number; token ids are integers, not booleans. Chat roles are OpenAI's
(system, developer, user, assistant, tool), content is a string or a list of text parts.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from specdec_core.request import MAX_INT32

MAX_STOP_CHARS = 256


class SpeculationOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

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
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


def _utf8(text: str) -> str:
    """A lone surrogate (JSON "\\ud800") is a str in Python but no text: refuse it here, not in the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return text


Utf8Str = Annotated[str, AfterValidator(_utf8)]
StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_utf8)]

# OpenAI fields this server does not implement, with the values that mean "not used": any other
# value is refused with a 400 naming the field (rather than silently ignored).
_UNSUPPORTED_DEFAULTS: dict[str, tuple] = {
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "top_logprobs": (None, 0), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "logprobs": (None, False, 0),
}


class _GenerationFields(BaseModel):
    # unknown fields are ignored, known unsupported ones refused; no lax coercion (module docstring)
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_INT32, description="0: no limit; above the vocabulary: no limit.")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: StopStr | list[StopStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None  # also the traffic-class domain of the acceptance statistics
    service_tier: str | None = None  # "flex" / "batch" / "scale": throughput objective in mode=auto
    ignore_eos: bool = False
    return_token_ids: bool = False
    speculation: SpeculationOptions | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported_field(self) -> str | None:
        """The first OpenAI field set to a value this server does not implement, or None."""
        fields = {**(self.model_extra or {}), **{k: getattr(self, k) for k in type(self).model_fields}}
        return next((name for name, allowed in _UNSUPPORTED_DEFAULTS.items()
                     if name in fields and fields[name] not in allowed), None)


class CompletionRequest(_GenerationFields):
    prompt: Utf8Str | list[int] | list[Utf8Str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)


class TextPart(BaseModel):
    """A content part; only text is supported (an image or audio part is refused naming its type)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: Utf8Str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Utf8Str | list[TextPart] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _fields_of_the_role(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool_call_id is required on tool messages and only there")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)


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

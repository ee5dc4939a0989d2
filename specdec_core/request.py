"""One request: its sampling parameters, its authoritative token history, the stopping rules
(EOS, token budget, stop strings, applied token by token), incremental detokenization and the
outputs it reports. Shared by the in-process engine and the router's separate-topology loop, so
both paths stop and detokenize identically.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from specdec_core.detokenizer import DetokenizerState, detokenize_incrementally
from specdec_core.stats import RequestStats

MAX_INT32 = 2**31 - 1
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it decode greedily


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    num_speculative_tokens: int = 0  # K; 0 = plain decoding; the upper bound of K when adaptive_k
    adaptive_k: bool = False  # re-choose K every step from the cost model and acceptance (engine needs one)
    domain: str = "default"  # traffic-class key for acceptance statistics (e.g. the OpenAI `user`)
    # The router's acceptance estimate for the request's traffic class (served adaptive and separate
    # requests): adaptive K, or the separate loop's overlap choice, shrinks the request's own evidence
    # towards it instead of its own estimate.
    class_acceptance: float | None = None

    def validate(self) -> None:
        """Refuse settings a step could not run (ValueError), so that one request cannot fail the
        batch it would share."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_INT32:
            raise ValueError(f"top_k must be in [0, {MAX_INT32}], got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # torch.Generator's seed range
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.class_acceptance is not None and not 0 <= self.class_acceptance <= 1:
            raise ValueError(f"class_acceptance must be in [0, 1], got {self.class_acceptance}")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")


    def normalized(self, vocab_size: int) -> SamplingParams:
        """The settings a step actually applies: a temperature below ``GREEDY_BELOW`` is greedy
        (dividing logits by it would overflow to inf and NaN), a top_k past the vocabulary is no limit."""
        temperature = 0.0 if self.temperature < GREEDY_BELOW else self.temperature
        top_k = 0 if self.top_k >= vocab_size else self.top_k
        return dataclasses.replace(self, temperature=temperature, top_k=top_k)


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # every output token so far (EOS excluded)
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stats: RequestStats
    new_token_ids: list[int]  # tokens added since this request's previous output
    new_text: str


    def merged(self, later: RequestOutput) -> RequestOutput:
        """This output followed by ``later``, as one message: the new tokens and text of both, the
        rest as ``later`` says (what a stream sends when it coalesces several steps)."""
        return dataclasses.replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                                   new_text=self.new_text + later.new_text)


def resumed_seed(seed: int, emitted: int) -> int:
    """The seed of a request resumed after ``emitted`` tokens (request migration): a stream of its own,
    derived from (seed, tokens so far); reusing the seed's stream would replay the uniforms that
    produced its output so far."""
    return hash((seed, emitted)) % 2**63


def eos_token_ids(tokenizer, generation_config=None) -> set[int]:
    """EOS ids from the tokenizer and the model's generation config (either may list several)."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


def stop_index(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the output is cut: the start of the stop string that is completed first in ``text``
    (smallest end; at a tie the longer stop), among occurrences starting at or after ``start``.
    Generation stops as soon as a stop appears, so a longer stop that would only complete later
    never counts, however the text is split into tokens. None if no stop occurs."""
    hits = [(i + len(s), i) for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits)[1] if hits else None


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that could still begin a stop string: those characters
    are held back from the stream until the next tokens show whether the stop follows."""
    return max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
               default=0)


class RequestState:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer, eos_ids: set[int]):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.arrival = time.perf_counter()
        self.tokens = list(prompt_ids)  # prompt + output: the authoritative history
        self.output_ids: list[int] = []
        self.text = ""  # decoded output; final (full decode, stop string cut) once finished
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        self.stats = RequestStats(prompt_tokens=len(prompt_ids))
        self._detok = DetokenizerState()
        self._sent_tokens = 0
        self._sent_text = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def resume(self, output_ids: list[int], sent_chars: int) -> None:
        """Continue a request that another replica started (request migration): its output so far
        becomes this state's, as if generated here, of which the client has seen ``sent_chars``
        characters; held-back text (a stop's possible prefix, an incomplete character) is sent
        from here, and a stop string may span the two parts."""
        self.output_ids = list(output_ids)
        self.tokens = self.prompt_ids + self.output_ids
        self.text = detokenize_incrementally(self.tokenizer, self.output_ids, self._detok)
        self._sent_tokens, self._sent_text = len(self.output_ids), sent_chars

    def budget_k(self, k: int, max_len: int, ahead: int = 0) -> int:
        """A verify emits up to K+1 tokens: proposing past the token budget or the context is waste.
        ``ahead``: the proposal follows that many tokens not yet committed (an overlapped round)."""
        remaining = self.params.max_new_tokens - len(self.output_ids) - ahead
        room = max_len - len(self.tokens) - ahead
        return max(0, min(k, remaining - 1, room))

    def commit(self, emitted: list[int]) -> None:
        """Append emitted tokens one by one, stopping at EOS, the token budget or a stop string."""
        for token in emitted:
            if token in self.eos_ids and not self.params.ignore_eos:
                self.finish("stop")
                return
            self.tokens.append(token)
            self.output_ids.append(token)
            if self.params.stop:
                # A stop may span tokens, or sit inside one long token with text on either side:
                # search every start a new character could complete.
                searched = max(0, len(self.text) - max(len(s) for s in self.params.stop) + 1)
                self.text += detokenize_incrementally(self.tokenizer, self.output_ids, self._detok)
                if stop_index(self.text, self.params.stop, searched) is not None:
                    self.finish("stop")
                    return
            if len(self.output_ids) >= self.params.max_new_tokens:
                self.finish("length")
                return

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.stats.latency_s = time.perf_counter() - self.arrival
        self.text = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        if self.params.stop:
            cut = stop_index(self.text, self.params.stop)
            self.text = self.text if cut is None else self.text[:cut]

    def output(self, stream_text: bool = True) -> RequestOutput:
        """What changed since the previous output. ``stream_text=False`` skips per-step
        detokenization; the text is then only set once the request finishes."""
        if stream_text and not self.finished and not self.params.stop:  # with stop strings commit advanced it
            self.text += detokenize_incrementally(self.tokenizer, self.output_ids, self._detok)
        self.stats.output_tokens = len(self.output_ids)
        new_ids = self.output_ids[self._sent_tokens :]
        visible = len(self.text)
        if self.params.stop and not self.finished:  # a partial stop is never streamed
            visible -= stop_prefix_len(self.text, self.params.stop)
        new_text = self.text[self._sent_text : visible]
        self._sent_tokens, self._sent_text = len(self.output_ids), max(self._sent_text, visible)
        return RequestOutput(
            self.request_id, list(self.output_ids), self.text, self.finished, self.finish_reason, self.stats,
            new_ids, new_text,
        )

"""Stop strings, OpenAI/vLLM semantics: the output ends right before the first stop string that
occurs in the generated text (the first one completed, reading left to right), whether the stop
spans tokens or sits inside one long token with text on either side; the stream never carries
text past the cut, not even a stop's prefix that the next token turns into the stop.

Checked on the shipped tokenizer, with hand-picked token sequences and with randomised ones fed
in chunks the way speculative steps commit them, and through the engine on the shipped pair.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specdec_core import Engine, SamplingParams
from specdec_core.request import RequestState
from specdec_core.runner import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
STOPS = ["\n", "):", "self.", " the", "\n\n"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(MODELS / "target"))


def _prompts(name: str, n: int) -> list[str]:
    with open(MODELS / "prompts" / f"{name}.jsonl") as f:
        return [json.loads(line)["prompt"] for line in f][:n]


def expected_cut(text: str, stops: list[str]) -> str:
    """Reference: read the text a character at a time; cut before the first stop it completes."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)]
    return text


def run(tokenizer, token_ids: list[int], stops: list[str], chunks: list[int]) -> tuple[RequestState, list[str]]:
    """Commit ``token_ids`` in chunks of the given sizes (a speculative step commits several),
    collecting the streamed text after every chunk."""
    req = RequestState("r", [0], SamplingParams(max_new_tokens=len(token_ids) + 1, stop=tuple(stops)),
                       tokenizer, eos_ids=set())
    streamed, i = [], 0
    for size in chunks:
        if req.finished or i >= len(token_ids):
            break
        req.commit(token_ids[i : i + size])
        i += size
        streamed.append(req.output().new_text)
    if not req.finished:
        req.finish("length")
        streamed.append(req.output().new_text)
    return req, streamed


def assert_exact(req: RequestState, streamed: list[str], full_text: str, stops: list[str]) -> None:
    want = expected_cut(full_text, stops)
    assert req.text == want
    assert req.finish_reason == ("stop" if want != full_text else "length")
    assert "".join(streamed) == want
    sent = ""
    for delta in streamed:  # what a client has seen is, at every moment, a prefix of the answer
        sent += delta
        assert want.startswith(sent)


def _long_tokens(tokenizer, min_chars: int) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special and len(tokenizer.decode([i])) >= min_chars
            and tokenizer.decode([i]).isprintable()]


def test_stop_inside_one_long_token(tokenizer):
    """The stop sits inside a single token with more than 8 characters after it."""
    token = next(t for t in _long_tokens(tokenizer, 12) if (w := tokenizer.decode([t])).find(w[1:3]) == 1)
    word = tokenizer.decode([token])
    stop = word[1:3]
    prefix = tokenizer.encode("Hello")
    req, streamed = run(tokenizer, prefix + [token] + tokenizer.encode(" more"), [stop], [1] * 10)
    assert_exact(req, streamed, tokenizer.decode(prefix + [token] + tokenizer.encode(" more")), [stop])
    assert req.text == "Hello" + word[:1]


def test_stop_spanning_tokens_is_never_streamed_in_part(tokenizer):
    """With stop "ab" over tokens "xa" | "bc" the stream must not send "xa": the final text is "x"."""
    ids = tokenizer.encode("He said the answer")
    text = tokenizer.decode(ids)
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    boundary = len(pieces[1])  # a stop that straddles the second token's end
    stop = text[boundary - 1 : boundary + 1]
    req, streamed = run(tokenizer, ids, [stop], [1] * len(ids))
    assert_exact(req, streamed, text, [stop])
    assert streamed[1] != pieces[1][len(pieces[0]):]  # the held-back character was not sent with token 2


def test_earliest_of_several_stops_wins(tokenizer):
    ids = tokenizer.encode("one two three four five")
    req, streamed = run(tokenizer, ids, ["five", " two", "three"], [3, 3, 3])
    assert req.text == "one" and "".join(streamed) == "one"


@pytest.mark.parametrize("source", ["code", "prose"])
def test_randomised_stops_and_chunks(tokenizer, source):
    """Real text, stops drawn from it and from the common list, tokens committed 1-5 at a time."""
    rng = random.Random(0)
    for prompt in _prompts(source, 20):
        ids = tokenizer.encode(prompt)
        text = tokenizer.decode(ids)
        for _ in range(4):
            start = rng.randrange(len(text))
            stops = [text[start : start + rng.randint(1, 6)], rng.choice(STOPS)]
            chunks = [rng.randint(1, 5) for _ in range(len(ids))]
            req, streamed = run(tokenizer, ids, stops, chunks)
            assert_exact(req, streamed, text, stops)


@pytest.fixture(scope="module")
def shipped_engine():
    return Engine.from_pretrained(str(MODELS / "target"), str(MODELS / "draft"), max_batch_size=40,
                                  max_model_len=512)


@pytest.mark.parametrize("k", [0, 4])
def test_shipped_pair_cuts_every_stop_exactly(shipped_engine, k):
    """The issue's case set: greedy code and prose prompts, common stops, plain and speculative."""
    prompts = _prompts("code", 20) + _prompts("prose", 20)
    free = shipped_engine.generate(prompts, max_new_tokens=40, mode="plain", seed=None)
    wrong = []
    for stop in STOPS:
        params = [SamplingParams(max_new_tokens=40, stop=(stop,), num_speculative_tokens=k) for _ in prompts]
        for ref, out in zip(free, shipped_engine.generate(prompts, params=params)):
            want = expected_cut(ref.text, [stop])
            reason = "stop" if want != ref.text else ref.finish_reason
            if out.text != want or out.finish_reason != reason:
                wrong.append((stop, ref.text, out.text))
    assert not wrong, wrong[:3]

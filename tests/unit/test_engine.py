"""Engine correctness: lossless greedy speculation, batching invariance, determinism, the KV cache,
stop conditions, fault degradation and input errors."""

import pytest
import torch
from distributions import exact_marginals, expected_tv
from transformers import AutoModelForCausalLM

from specdec_core import Engine, SamplingParams, StepCosts
from specdec_core.proposers import NgramProposer

# A verify nearly free, a cheap draft: speculation pays at any acceptance the tiny draft reaches.
PAYING_COSTS = StepCosts(batches=(1, 16), qs=(1, 9), target_s=((0.010, 0.011), (0.012, 0.016)), draft_s=(0.0005, 0.001))
PROMPTS = [
    "It is a truth universally acknowledged",
    "def fibonacci(n):",
    [5, 9, 12],
    "In the beginning God created the heaven and the earth. And the earth was without form",
]


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_batch_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def self_draft_engine(tiny_models):
    """Draft == target: every proposal is accepted, which exercises the bonus-token path."""
    return Engine.from_pretrained(tiny_models["target"], tiny_models["target"], max_batch_size=8, max_model_len=256)


@pytest.fixture(scope="module")
def ngram_engine(tiny_models):
    return Engine.from_pretrained(tiny_models["target"], proposer="ngram", max_batch_size=8, max_model_len=256)


@pytest.fixture(scope="module")
def plain_reference(engine):
    return [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=24, mode="plain")]


def test_plain_matches_hf_generate(tiny_models, engine):
    model = AutoModelForCausalLM.from_pretrained(tiny_models["target"])
    for prompt in PROMPTS[:2]:
        ids = engine.encode(prompt)
        hf = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        ours = engine.generate([prompt], max_new_tokens=16, mode="plain")[0].token_ids
        expected = hf[0, len(ids):].tolist()
        eos = engine.eos_token_ids
        expected = expected[: next((i for i, t in enumerate(expected) if t in eos), len(expected))]
        assert ours == expected


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_plain(engine, plain_reference, k):
    outs = engine.generate(PROMPTS, max_new_tokens=24, mode="speculative", num_speculative_tokens=k)
    assert [o.token_ids for o in outs] == plain_reference
    assert all(o.stats.proposed > 0 for o in outs)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_full_acceptance_equals_plain(self_draft_engine, plain_reference, k):
    outs = self_draft_engine.generate(PROMPTS, max_new_tokens=24, num_speculative_tokens=k)
    assert [o.token_ids for o in outs] == plain_reference
    for o in outs:
        assert o.stats.acceptance_rate == 1.0
        assert o.stats.mean_acceptance_length > 1.0


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_ngram_equals_plain(ngram_engine, plain_reference, k):
    outs = ngram_engine.generate(PROMPTS, max_new_tokens=24, num_speculative_tokens=k)
    assert [o.token_ids for o in outs] == plain_reference


def test_mixed_batch_of_plain_and_speculative(engine, plain_reference):
    params = [SamplingParams(max_new_tokens=24, num_speculative_tokens=k) for k in (0, 3, 0, 7)]
    outs = engine.generate(PROMPTS, params=params)
    assert [o.token_ids for o in outs] == plain_reference
    assert outs[0].stats.proposed == 0 and outs[1].stats.proposed > 0


@pytest.mark.parametrize("sinks", [0, 2])
def test_greedy_with_a_bounded_draft_cache_equals_plain(tiny_models, plain_reference, sinks):
    """The target as its own draft over a ring of 6 + 2 columns (prompts and outputs pass it many times
    over): the window makes the draft disagree with the target, and the output is still plain's."""
    from specdec_core import KVWindow

    engine = Engine.from_pretrained(tiny_models["target"], tiny_models["target"], max_batch_size=8, max_model_len=256,
                                    draft_kv_window=KVWindow(sinks=sinks, window=6, slack=2))
    assert engine.proposer.runner.cache.keys[0].shape[2] == sinks + 6 + 2 + 1
    outs = engine.generate(PROMPTS, max_new_tokens=24, num_speculative_tokens=4)
    assert [o.token_ids for o in outs] == plain_reference
    assert 0 < sum(o.stats.accepted for o in outs) < sum(o.stats.proposed for o in outs)


def test_budgeted_verification_is_lossless_with_a_k_per_row(tiny_models, plain_reference):
    """Budgeted auto (one plan per step, each row at its own K, verified ragged) on costs where
    speculation pays, rows capped at different K, the target as its own draft (every draft token
    accepted, so the plan goes deep): greedy output equals plain token for token, and steps did run
    rows at different K."""
    engine = Engine.from_pretrained(tiny_models["target"], tiny_models["target"], max_batch_size=16, max_model_len=256)
    engine.enable_adaptive(PAYING_COSTS, budgeted=True)
    params = [SamplingParams(max_new_tokens=24, num_speculative_tokens=k, adaptive_k=True) for k in (8, 3, 8, 5)]
    trace = []
    outs = engine.generate(PROMPTS, params=params, trace=trace)
    assert [o.token_ids for o in outs] == plain_reference
    assert any(len(set(s.ks)) > 1 and max(s.ks) > 0 for s in trace)  # a ragged step
    assert sum(o.stats.proposed for o in outs) > 0


@pytest.mark.parametrize("k", [0, 3, 7])
def test_prefills_verified_beside_decode_rows_change_no_output(engine, plain_reference, k):
    """Requests arriving one a step: each one's prefill runs in the running rows' verify forward (one
    packed forward, the prefill attended alone beside the verify rows: ``runner.attention_split``).
    Greedy output is plain's alone, and a seeded sampled request decodes as it does alone."""
    sampled = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.95, num_speculative_tokens=k, seed=11)
    alone = engine.generate([PROMPTS[0]], params=[sampled])[0].token_ids
    params = [SamplingParams(max_new_tokens=24, num_speculative_tokens=k) for _ in PROMPTS] + [sampled]
    ids, outs, packed = [], {}, 0
    for prompt, p in zip(PROMPTS + PROMPTS[:1], params):
        ids.append(engine.add_request(prompt, p))
        for out in engine.step():
            outs[out.request_id] = out
        packed += bool(engine.last_step.prefill_rows and engine.last_step.batch)
    while engine.has_work():
        for out in engine.step():
            outs[out.request_id] = out
    assert packed == len(PROMPTS)  # every later arrival shared a forward with the rows already decoding
    assert [outs[i].token_ids for i in ids[:-1]] == plain_reference
    assert outs[ids[-1]].token_ids == alone


def test_batched_equals_one_at_a_time(engine):
    kw = dict(max_new_tokens=16, temperature=0.8, top_p=0.95, num_speculative_tokens=3, seed=11)
    batched = engine.generate(PROMPTS, **kw)
    for i, prompt in enumerate(PROMPTS):
        solo = engine.generate([prompt], **{**kw, "seed": 11 + i})[0]
        assert solo.token_ids == batched[i].token_ids


def test_stats_say_the_batch_a_request_decoded_in(engine):
    """Two requests together, then one of them alone: the short one decoded at batch 2 throughout, the
    long one at 2 for its first steps and at 1 after (what the router learns served drift at)."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (4, 12)]
    short, long_ = engine.generate(PROMPTS[:2], params=params)
    assert (short.stats.decode_steps, short.stats.mean_decode_batch) == (3, 2.0)
    assert long_.stats.decode_steps == 11 and long_.stats.mean_decode_batch == pytest.approx((3 * 2 + 8) / 11)


def test_a_step_records_the_context_it_ran_at(engine):
    """``last_step.context_len``: the decode rows' mean tokens when the step ran, rounded up (what the step is
    priced at, and what the budget benchmark prices it at)."""
    engine.add_request([5, 9, 12], SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.add_request([7] * 20, SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()  # both prefills: one token each
    contexts = []
    while engine.has_work():
        engine.step()
        if engine.last_step.batch:
            contexts.append(engine.last_step.context_len)
    assert contexts == list(range(13, 20))  # (3 + 1 + 20 + 1) / 2 rounded up, growing a token a step


def test_seeded_sampling_is_deterministic(engine):
    a = engine.generate(PROMPTS, max_new_tokens=16, temperature=1.0, num_speculative_tokens=4, seed=5)
    b = engine.generate(PROMPTS, max_new_tokens=16, temperature=1.0, num_speculative_tokens=4, seed=5)
    c = engine.generate(PROMPTS, max_new_tokens=16, temperature=1.0, num_speculative_tokens=4, seed=6)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


@pytest.mark.parametrize("ks", [(3,), (3, 1, 0, 2)], ids=["uniform", "ragged"])
def test_sampled_speculation_follows_the_target_distribution(tiny_models, noisy_draft, ks):
    """Lossless sampling through the engine at T=1 with top-k and top-p: output tokens 2 and 3,
    produced by verifies against a draft that agrees only partly with the target (accepted,
    recovered and bonus tokens all occur), follow the target's exact marginals, with every row at
    K=3 and with rows at their own K in one ragged (packed) verify. The bound (2x the sampling noise)
    separates the correct sampler (measured ~1.0x) from one that draws the recovered token from p
    instead of norm(max(0, p - q)) (~3x) or accepts every draft token (~10x)."""
    n, prompt, knobs = 3000, [7, 3, 11], dict(temperature=1.0, top_k=8, top_p=0.9)
    engine = Engine.from_pretrained(tiny_models["target"], noisy_draft, max_batch_size=64, max_model_len=64)
    params = [SamplingParams(max_new_tokens=5, seed=i, num_speculative_tokens=ks[i % len(ks)], ignore_eos=True,
                             **knobs) for i in range(n)]
    outs = engine.generate([prompt] * n, params=params)
    proposed, accepted = sum(o.stats.proposed for o in outs), sum(o.stats.accepted for o in outs)
    assert proposed >= sum(ks) / len(ks) * n and 0.1 < accepted / proposed < 0.9  # accepts and rejects both
    assert sum(o.stats.accepted_per_position[2] for o in outs if o.stats.proposed_per_position[2:]) > 20  # bonuses
    for position, exact in list(enumerate(exact_marginals(tiny_models["target"], prompt, 3, **knobs)))[1:]:
        hist = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=exact.numel()) / n
        tv = 0.5 * (hist - exact).abs().sum().item()
        assert tv < 2 * expected_tv(exact, n), (position, tv, expected_tv(exact, n))


def test_kv_cache_is_preallocated_and_slots_return(engine):
    ptrs = engine.target.cache.storage_ptrs()
    draft_runner = engine.proposer.runner
    draft_ptrs = draft_runner.cache.storage_ptrs()
    engine.generate(PROMPTS * 3, max_new_tokens=30, num_speculative_tokens=4)
    assert engine.target.cache.storage_ptrs() == ptrs
    assert draft_runner.cache.storage_ptrs() == draft_ptrs
    assert engine.target.num_free_slots == engine.target.num_slots
    assert draft_runner.num_free_slots == draft_runner.num_slots
    assert engine.proposer.num_sequences() == 0


def test_more_requests_than_slots_queue_and_finish(tiny_models):
    small = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_batch_size=2, max_model_len=128)
    outs = small.generate(PROMPTS * 2, max_new_tokens=8, num_speculative_tokens=2)
    assert all(o.finished and len(o.token_ids) > 0 for o in outs)
    assert small.target.num_free_slots == 2


def test_stop_string_and_max_tokens(engine):
    full = engine.generate([PROMPTS[0]], max_new_tokens=24, mode="plain")[0]
    assert full.finish_reason in ("length", "stop")
    stop = full.text[5:8]
    cut = engine.generate([PROMPTS[0]], max_new_tokens=24, stop=[stop], num_speculative_tokens=4)[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and full.text.startswith(cut.text)
    assert len(engine.generate([PROMPTS[0]], max_new_tokens=3)[0].token_ids) == 3


def test_eos_stops_generation(engine, plain_reference):
    eos_engine_ids = engine.eos_token_ids
    ref = plain_reference[1]
    engine.eos_token_ids = {ref[4]}
    try:
        out = engine.generate([PROMPTS[1]], max_new_tokens=24, num_speculative_tokens=3)[0]
    finally:
        engine.eos_token_ids = eos_engine_ids
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[: ref.index(ref[4])]


def test_failed_draft_degrades_to_plain(tiny_models, plain_reference):
    eng = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_batch_size=8, max_model_len=256)

    def broken(requests):
        raise RuntimeError("draft replica lost")

    eng.proposer.propose = broken
    outs = eng.generate(PROMPTS, max_new_tokens=24, num_speculative_tokens=4)
    assert [o.token_ids for o in outs] == plain_reference
    assert all(o.stats.proposed == 0 for o in outs)


def test_abort_frees_slots(engine):
    rid = engine.add_request("It is a truth", SamplingParams(max_new_tokens=50, num_speculative_tokens=3))
    engine.step()
    engine.step()
    engine.abort(rid)
    outs = engine.step()
    assert any(o.request_id == rid and o.finish_reason == "abort" for o in outs)
    assert not engine.has_work()
    assert engine.target.num_free_slots == engine.target.num_slots
    assert engine.proposer.num_sequences() == 0


def test_streamed_deltas_concatenate_to_final(engine):
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=20, num_speculative_tokens=3))
    text, ids, final = "", [], None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid:
                text += out.new_text
                ids += out.new_token_ids
                final = out
    assert final.finished and text == final.text and ids == final.token_ids


def test_a_request_that_fails_a_step_fails_alone(engine, plain_reference):
    """One request whose verify raises (a fault injected into the real verifier for its rows only)
    ends with finish_reason "error"; the requests sharing its steps finish whole and correct."""
    verify = engine.verifier.verify

    def verify_failing_for_poison(items):
        if any(item.seq_id == "poison" for item in items):
            raise RuntimeError("injected fault")
        return verify(items)

    engine.verifier.verify = verify_failing_for_poison
    try:
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=24, num_speculative_tokens=3)) for p in PROMPTS]
        engine.add_request("It is", SamplingParams(max_new_tokens=24, num_speculative_tokens=3), "poison")
        done = {}
        while engine.has_work():
            done.update({o.request_id: o for o in engine.step(stream_text=False) if o.finished})
    finally:
        engine.verifier.verify = verify
    assert done["poison"].finish_reason == "error"
    assert [done[i].token_ids for i in ids] == plain_reference
    assert engine.target.num_free_slots == engine.target.num_slots and engine.proposer.num_sequences() == 0


def test_a_resumed_request_continues_exactly(engine, plain_reference):
    """Migration's core: a request resumed from the first n tokens of its output (as another
    replica emitted them) emits exactly the rest of the fault-free output, and its stream carries
    exactly the text the client had not yet seen, for every cut and with speculation."""
    full = engine.generate([PROMPTS[1]], max_new_tokens=24, mode="plain")[0]
    text_of = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)
    for n, k in [(1, 0), (7, 3), (23, 4)]:
        sent = len(text_of(full.token_ids[:n])) - 1  # one character of theirs still held back
        rid = engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=24, num_speculative_tokens=k),
                                 resume=(full.token_ids[:n], sent))
        ids, text = [], ""
        while engine.has_work():
            for out in engine.step():
                if out.request_id == rid:
                    ids, text = ids + out.new_token_ids, text + out.new_text
        assert full.token_ids[:n] + ids == plain_reference[1], n
        assert full.text[:sent] + text == full.text, n


def test_extreme_but_valid_settings_decode(engine, plain_reference):
    """A temperature too small to divide by is greedy; a top_k past the vocabulary is no limit."""
    tiny_t = engine.generate(PROMPTS, max_new_tokens=24, temperature=1e-300, num_speculative_tokens=3)
    assert [o.token_ids for o in tiny_t] == plain_reference
    kw = dict(max_new_tokens=12, temperature=1.0, seed=3, num_speculative_tokens=3)
    huge_k = engine.generate(PROMPTS, top_k=10**9, **kw)
    assert [o.token_ids for o in huge_k] == [o.token_ids for o in engine.generate(PROMPTS, top_k=0, **kw)]


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(max_new_tokens=0), "max_new_tokens"),
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(num_speculative_tokens=-1), "num_speculative_tokens"),
        (SamplingParams(max_new_tokens=500), "context limit"),
        (SamplingParams(top_k=2**64), "top_k"),
        (SamplingParams(seed=2**64), "seed"),
        (SamplingParams(seed=-(2**63) - 1), "seed"),
        (SamplingParams(stop=("",)), "stop"),
    ],
)
def test_bad_params_raise(engine, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("hello", params)


def test_bad_prompts_raise(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([10**6], SamplingParams())


def test_different_tokenizers_rejected_at_load(tiny_models, tmp_path):
    from transformers import AutoTokenizer

    from modelzoo.random_init import build_model

    tok = AutoTokenizer.from_pretrained(tiny_models["target"])
    tok.add_tokens(["<extra_token>"])
    other = build_model(str(tmp_path / "other"), tok, num_layers=1, seed=3)
    with pytest.raises(ValueError, match="different tokenizers"):
        Engine.from_pretrained(tiny_models["target"], other)


def test_ngram_proposer_finds_latest_repeat():
    prop = NgramProposer(min_n=1, max_n=3)
    assert prop._lookup([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert prop._lookup([1, 2, 3], 4) == []

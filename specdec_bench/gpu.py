"""`specdec-bench gpu`: the regime sweep on CUDA with larger random-initialised shapes and an
*oracle draft of controlled acceptance*: it proposes the target's own greedy token with
probability a (else the draft model's own token), while running a real draft model so the draft
cost is paid. Greedy verification then accepts each position with probability ~a, so the sweep
maps speedup over (batch x acceptance) at a known a, next to the cost model's prediction from
costs calibrated on the device. Sized to finish in under 8 minutes on one H100/H200.
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_bench.common import machine_facts
from specdec_core import Engine, SamplingParams
from specdec_core.calibration import calibrate
from specdec_core.costmodel import CostModel
from specdec_core.proposers import DraftModelProposer, Proposal, ProposalRequest
from specdec_core.runner import ModelRunner


class OracleProposer(DraftModelProposer):
    """A real draft model's forwards, with tokens replaced by the target's greedy reference
    continuation with probability ``a``. q is one-hot (greedy), so acceptance is ~a per position."""

    def __init__(self, runner: ModelRunner, references: dict[tuple, list[int]], acceptance: float, seed: int = 0):
        super().__init__(runner, name=f"oracle-a{acceptance}")
        self.references = references  # prompt tuple -> full greedy sequence (prompt + continuation)
        self.acceptance = acceptance
        self.rng = random.Random(seed)
        self._ref_of: dict[str, list[int] | None] = {}

    def _reference(self, req: ProposalRequest) -> list[int] | None:
        if req.seq_id not in self._ref_of:
            self._ref_of[req.seq_id] = next(
                (seq for key, seq in self.references.items() if req.token_ids[: len(key)] == list(key)), None
            )
        return self._ref_of[req.seq_id]

    def release(self, seq_id: str) -> None:
        super().release(seq_id)
        self._ref_of.pop(seq_id, None)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        drafted = super().propose(requests)
        out = []
        for req, prop in zip(requests, drafted):
            ref = self._reference(req)
            tokens = []
            for i, tok in enumerate(prop.token_ids):
                pos = len(req.token_ids) + i
                truth = ref[pos] if ref is not None and pos < len(ref) else None
                if truth is not None and self.rng.random() < self.acceptance:
                    tokens.append(truth)
                else:
                    tokens.append(tok if tok != truth else (tok + 1) % self.runner.vocab_size)
            out.append(Proposal(tokens, None))
        return out


def _model(hidden: int, layers: int, vocab: int, device, dtype, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 3.5) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
                      num_key_value_heads=max(1, hidden // 512),
                      max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    return model


def run_gpu(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("specdec-bench gpu needs a CUDA device (or --device cpu for a smoke run)")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    vocab = args.vocab
    target = _model(args.hidden, args.layers, vocab, device, dtype, 0)
    draft = _model(args.hidden // 4, 2, vocab, device, dtype, 1)
    max_batch = max(args.batches)
    tokenizer = _NullTokenizer()
    target_runner = ModelRunner(target, max_slots=max_batch, max_len=args.context + args.new_tokens + 16)
    draft_runner = ModelRunner(draft, max_slots=max_batch, max_len=args.context + args.new_tokens + 16)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.context,), generator=gen).tolist() for _ in range(max_batch)]
    plain_engine = Engine(target_runner, tokenizer, None, max_batch_size=max_batch)
    params = lambda k: [SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True,
                                       num_speculative_tokens=k) for _ in prompts]
    refs = plain_engine.generate(prompts, params=params(0))
    references = {tuple(p): p + o.token_ids for p, o in zip(prompts, refs)}
    draft_engine = Engine(target_runner, tokenizer, DraftModelProposer(draft_runner), max_batch_size=max_batch)
    costs = calibrate(draft_engine, batches=tuple(args.batches), qs=(1, args.k + 1), context_len=args.context)
    model = CostModel(costs)
    rows = []
    t_start = time.time()
    for a in args.acceptances:
        engine = Engine(target_runner, tokenizer, OracleProposer(draft_runner, references, a), max_batch_size=max_batch)
        for b in args.batches:
            def timed(k, engine=engine, b=b):
                sync()
                t0 = time.perf_counter()
                outs = engine.generate(prompts[:b], params=params(k)[:b])
                sync()
                return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0), outs
            timed(0), timed(args.k)  # warm-up
            plains, specs, outs = [], [], []
            for _ in range(args.reps):  # interleaved, so a slow spell of the machine hits both modes
                plains.append(timed(0)[0])
                tok_s, rep_outs = timed(args.k)
                specs.append(tok_s)
                outs += rep_outs
            plain, spec = statistics.median(plains), statistics.median(specs)
            judged = sum(sum(o.stats.proposed_per_position) for o in outs)
            measured_a = sum(o.stats.accepted for o in outs) / judged if judged else 0.0
            pred = model.plain_time_per_token(b) / model.spec_time_per_token(b, args.k, measured_a)
            rows.append({"acceptance_target": a, "acceptance": measured_a, "batch": b, "k": args.k,
                         "plain_tok_s": plain, "spec_tok_s": spec, "speedup": spec / plain, "runs": args.reps,
                         "predicted_speedup": pred, "cost_ratio": model.cost_ratio(b)})
            print(f"a={a} b={b}: plain {plain:.0f} spec {spec:.0f} tok/s speedup {spec / plain:.2f} "
                  f"(pred {pred:.2f}) measured a {measured_a:.2f}  [{time.time() - t_start:.0f}s]", flush=True)
    return {"machine": machine_facts(torch.get_num_threads()),
            "config": {k: v for k, v in vars(args).items() if k not in ("func", "out")},
            "costs": costs.to_dict(), "rows": rows}


class _NullTokenizer:
    """Synthetic token ids need no text; decode returns an empty string."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""

    def __call__(self, text):
        raise ValueError("the GPU sweep uses token-id prompts")


def gpu_markdown(data: dict) -> str:
    lines = ["# GPU regime sweep (oracle draft of controlled acceptance)", "", f"Machine: {data['machine']}",
             f"Config: {data['config']}", "",
             "| target a | measured a | batch | K | plain tok/s | spec tok/s | speedup | predicted | cost ratio |",
             "|---" * 9 + "|"]
    for r in data["rows"]:
        lines.append(f"| {r['acceptance_target']} | {r['acceptance']:.2f} | {r['batch']} | {r['k']} | "
                     f"{r['plain_tok_s']:.0f} | {r['spec_tok_s']:.0f} | **{r['speedup']:.2f}** | "
                     f"{r['predicted_speedup']:.2f} | {r['cost_ratio']:.3f} |")
    return "\n".join(lines) + "\n"

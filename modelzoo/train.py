"""Train the model family (tokenizer, target, drafts) on the offline corpus, on CPU.

    python -m modelzoo.train --all                       # corpus, tokenizer, prompts, every model
    python -m modelzoo.train --tokenizer                 # tokenizer + token arrays + prompt sets
    python -m modelzoo.train --model target --minutes 65 --threads 2
    python -m modelzoo.train --model draft --minutes 14 --threads 1   # needs models/target
    python -m modelzoo.train --model dram/target --threads 1          # grown from models/target

Two families: the tiny one (``target``, ``draft``, ...: the test fixtures, 3.4M-parameter target
that fits in a CPU's L3) and ``dram/`` (the served default: a target grown from the tiny one,
function-preserving (Net2Net, Chen et al. 2016), large enough that a decode step streams its
weights from DRAM as a GPU's step streams HBM).

Checkpoints (resumable: rerunning the same command continues where it stopped, the
time budget counts the time already spent) live in data/checkpoints/<name>.pt; the
final model is written to models/<name>/ with save_pretrained (fp32 safetensors) and
the tokenizer. AdamW, linear warmup then cosine decay over the time budget (the LR
schedule is a function of elapsed training time, so a budget in minutes is honoured
exactly), gradient clipping at 1.0.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

DATA = Path(os.environ.get("SPECDEC_DATA", "data"))  # corpus, token arrays, checkpoints (not in git)
CORPUS = DATA / "corpus"
TOKENS = DATA / "tokens"
CKPT = DATA / "checkpoints"
MODELS = Path("models")
VOCAB = 4096
EOS = "<|endoftext|>"
PAD = "<|pad|>"


@dataclass
class Spec:
    """One model of the family: architecture + how it is trained."""
    layers: int
    hidden: int
    heads: int
    intermediate: int
    mix: dict = field(default_factory=lambda: {"prose": 0.5, "code": 0.5})  # domain -> share of sequences
    teacher: str | None = None        # distil from models/<teacher> (KL at temperature T + CE)
    init_layers: list | None = None   # start from the teacher: its embedding, final norm and these layers
    grow_from: str | None = None      # start from models/<grow_from>, widened and deepened (modelzoo/grow.py)
    new_layers: list = field(default_factory=list)  # with grow_from: where identity layers are inserted
    kd_alpha: float = 0.8             # weight of T^2 * KL; (1 - alpha) on CE
    kd_temp: float = 1.5
    lr: float = 2e-3
    minutes: float = 14.0
    seq_len: int = 256
    batch: int = 16
    note: str = ""


FAMILY = {
    "target": Spec(6, 192, 6, 512, lr=2e-3, minutes=82, note="the target: both domains, plain CE"),
    "draft": Spec(2, 192, 6, 512, mix={"prose": 0.35, "code": 0.65}, teacher="target", init_layers=[0, 5],
                  lr=1.5e-3, minutes=28,
                  note="cheap aligned draft: target's embedding + layers 0 and 5, distilled from the target's logits "
                       "on both domains (first 15 min at 50/50, then 13 min at 35/65 prose/code: "
                       "code agreement lagged)"),
    "draft-code": Spec(1, 128, 4, 384, mix={"code": 1.0}, lr=3e-3, minutes=12,
                       note="domain-mismatch draft: Python code only, plain CE, no target"),
    "draft-large": Spec(5, 192, 6, 512, teacher="target", init_layers=[0, 1, 2, 4, 5], lr=1e-3, minutes=14,
                        note="expensive draft: target's embedding + layers 0,1,2,4,5, distilled from the target"),
    # The served family: 576 = 3 x 192 wide (each residual coordinate of `target` tripled), 18 heads of the
    # same head_dim, ffn 1536 = 3 x 512, two identity layers inserted: 34M parameters, 137 MB of fp32 weights
    # (4x a 32 MiB L3), starting exactly at `target`'s function.
    "dram/target": Spec(8, 576, 18, 1536, grow_from="target", new_layers=[3, 6], lr=3e-4, minutes=95,
                        note="the served target: grown from `target` (Net2Net, function-preserving), trained further "
                             "on both domains, plain CE"),
    # The served family's cheap aligned draft: the tiny `draft` widened 2x (Net2Net, so it starts at that draft's
    # function, 0.67 greedy agreement with `dram/target`), distilled from `dram/target`: 2 x 384, ~1/10 of a step.
    "dram/draft": Spec(2, 384, 12, 1024, teacher="dram/target", grow_from="draft", lr=1e-3, minutes=35,
                       note="cheap aligned draft: the tiny `draft` widened to 384 (Net2Net), distilled from "
                            "`dram/target`'s logits on both domains"),
    # The served family's expensive draft: the target's own layers 0-4 and 7, taken as they are (a layer-skipping
    # draft, as self-speculation builds one): 6/8 of the target's cost for the cheap draft's agreement (~0.70):
    # the seed's "draft too large". Dropping only the two layers inserted at growth (3 and 6) gives a near copy
    # (agreement 0.98; 0.91 after 10 min of distillation), which at c = 0.74 breaks even at K = 4 (0.96x and
    # 1.01x in two full sweeps): a draft that costs much loses only when it is not near the target itself.
    "dram/draft-large": Spec(6, 576, 18, 1536, teacher="dram/target", init_layers=[0, 1, 2, 3, 4, 7], minutes=0,
                             note="expensive draft: `dram/target`'s layers 0-4 and 7 as they are (layer skipping, "
                                  "not distilled)"),
}


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(out_dir: Path = DATA / "tokenizer") -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from modelzoo.corpus import DOMAINS, read_jsonl

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS, PAD], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def texts():
        for d in DOMAINS:
            for r in read_jsonl(CORPUS / d / "train.jsonl"):
                yield r["text"]

    tok.train_from_iterator(texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=None, model_max_length=2048)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    log(f"tokenizer: vocab {len(fast)} -> {out_dir}")
    return out_dir


def tokenize_corpus(tok_dir: Path = DATA / "tokenizer"):
    """data/tokens/<domain>_<split>.npy: uint16 ids, documents joined by EOS."""
    from transformers import AutoTokenizer

    from modelzoo.corpus import DOMAINS, read_jsonl

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    eos = tok.eos_token_id
    TOKENS.mkdir(parents=True, exist_ok=True)
    for d in DOMAINS:
        for split in ("train", "heldout"):
            rows = read_jsonl(CORPUS / d / f"{split}.jsonl")
            enc = tok([r["text"] for r in rows], add_special_tokens=False)["input_ids"]
            ids = []
            for e in enc:
                ids.extend(e)
                ids.append(eos)
            arr = np.asarray(ids, dtype=np.uint16)
            np.save(TOKENS / f"{d}_{split}.npy", arr)
            log(f"tokens {d}/{split}: {len(arr):,}")


def load_tokens(domain: str, split: str) -> np.ndarray:
    return np.load(TOKENS / f"{domain}_{split}.npy")


# ----------------------------------------------------------------------------- model
def make_model(spec: Spec, tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embedding counted once


class Batcher:
    """Random windows of seq_len+1 tokens; each row's domain drawn from the mix."""

    def __init__(self, mix: dict, seq_len: int, batch: int, split="train", seed=0):
        self.data = {d: load_tokens(d, split) for d in mix}
        self.doms = list(mix)
        self.p = np.array([mix[d] for d in self.doms], dtype=np.float64)
        self.p /= self.p.sum()
        self.T, self.B = seq_len, batch
        self.rng = np.random.default_rng(seed)

    def next(self):
        import torch
        rows = []
        for d in self.rng.choice(self.doms, size=self.B, p=self.p):
            arr = self.data[d]
            s = self.rng.integers(0, len(arr) - self.T - 1)
            rows.append(arr[s:s + self.T + 1].astype(np.int64))
        x = torch.from_numpy(np.stack(rows))
        return x[:, :-1], x[:, 1:]


def heldout_batches(domain: str, seq_len=256, n_seq=16):
    """Fixed, evenly spaced windows of the held-out split (same every call)."""
    import torch
    arr = load_tokens(domain, "heldout")
    starts = np.linspace(0, len(arr) - seq_len - 2, n_seq).astype(np.int64)
    x = torch.from_numpy(np.stack([arr[s:s + seq_len + 1].astype(np.int64) for s in starts]))
    return x[:, :-1], x[:, 1:]


def heldout_loss(model, domain: str, seq_len=256, n_seq=16) -> float:
    import torch
    import torch.nn.functional as F
    x, y = heldout_batches(domain, seq_len, n_seq)
    model.eval()
    with torch.no_grad():
        tot = 0.0
        for i in range(0, len(x), 8):
            logits = model(input_ids=x[i:i + 8]).logits
            tot += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y[i:i + 8].reshape(-1), reduction="sum").item()
    model.train()
    return tot / y.numel()


_BIGRAM_CACHE: dict = {}


def bigram_heldout(domain: str, seq_len=256, n_seq=16) -> float:
    """Interpolated-bigram NLL on the same held-out windows heldout_loss uses (training-time monitor)."""
    from modelzoo.bigram import Bigram
    if domain not in _BIGRAM_CACHE:
        bg = Bigram(VOCAB).add(load_tokens(domain, "train"))
        held = load_tokens(domain, "heldout")
        lam = bg.tune(held)
        x, y = heldout_batches(domain, seq_len, n_seq)
        full = np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1)
        _BIGRAM_CACHE[domain] = float(np.mean([bg.nll(r, lam) for r in full]))
    return _BIGRAM_CACHE[domain]


# ----------------------------------------------------------------------------- training
def lr_at(spec: Spec, step: int, frac: float, warmup=150, floor=0.1) -> float:
    if step < warmup:
        return spec.lr * (step + 1) / warmup
    frac = min(max(frac, 0.0), 1.0)
    return spec.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def train_model(name: str, minutes: float | None, threads: int, eval_every_min=4.0, ckpt_every_min=3.0,
                fresh=False):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    spec = FAMILY[name]
    budget_s = 60.0 * (minutes if minutes is not None else spec.minutes)
    tok = AutoTokenizer.from_pretrained(str(DATA / "tokenizer"))
    model = make_model(spec, tok)
    teacher = None
    if spec.teacher:
        teacher = AutoModelForCausalLM.from_pretrained(str(MODELS / spec.teacher), dtype=torch.float32).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        assert teacher.config.vocab_size == model.config.vocab_size
        if spec.init_layers:
            init_from_teacher(model, teacher, spec.init_layers)
    if spec.grow_from:
        from modelzoo.grow import grow

        grow(model, AutoModelForCausalLM.from_pretrained(str(MODELS / spec.grow_from), dtype=torch.float32),
             spec.new_layers)
        log(f"grown from models/{spec.grow_from} (identity layers at {spec.new_layers})")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)
    state = {"step": 0, "elapsed": 0.0, "tokens": 0, "history": []}
    CKPT.mkdir(parents=True, exist_ok=True)
    ck = CKPT / f"{name.replace('/', '_')}.pt"
    if ck.exists() and not fresh:
        c = torch.load(ck, weights_only=False)
        model.load_state_dict(c["model"])
        opt.load_state_dict(c["opt"])
        state = c["state"]
        log(f"resumed {name} at step {state['step']}, {state['elapsed'] / 60:.1f} min, {state['tokens']:,} tokens")
    batcher = Batcher(spec.mix, spec.seq_len, spec.batch, seed=1000 + state["step"])
    log(f"{name}: {n_params(model):,} params, L={spec.layers} H={spec.hidden}, budget {budget_s / 60:.1f} min, "
        f"threads {threads}, mix {spec.mix}, teacher {spec.teacher}")

    def save_ckpt():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state, "spec": asdict(spec)}, ck)

    def evaluate():
        parts = []
        for d in ("prose", "code"):
            l = heldout_loss(model, d)
            parts.append(f"{d} {l:.3f} (bigram {bigram_heldout(d):.3f})")
            state.setdefault("heldout", {})[d] = l
        if teacher is not None:
            x, _ = heldout_batches("prose", 128, 8)
            x2, _ = heldout_batches("code", 128, 8)
            with torch.no_grad():
                model.eval()
                agr = []
                for xx in (x, x2):
                    agr.append((model(input_ids=xx).logits.argmax(-1) == teacher(input_ids=xx).logits.argmax(-1))
                               .float().mean().item())
                model.train()
            parts.append(f"agree prose {agr[0]:.3f} code {agr[1]:.3f}")
        log(f"[eval {name}] step {state['step']} held-out nats/token: " + ", ".join(parts))

    model.train()
    t_last_eval = t_last_ckpt = time.time()
    ema = None
    while state["elapsed"] < budget_s:
        t0 = time.time()
        x, y = batcher.next()
        lr = lr_at(spec, state["step"], state["elapsed"] / budget_s)
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(input_ids=x).logits
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        if teacher is not None:
            with torch.no_grad():
                tl = teacher(input_ids=x).logits
            T = spec.kd_temp
            kl = F.kl_div(F.log_softmax(logits / T, -1).reshape(-1, logits.size(-1)),
                          F.log_softmax(tl / T, -1).reshape(-1, logits.size(-1)),
                          log_target=True, reduction="batchmean") * T * T
            loss = spec.kd_alpha * kl + (1 - spec.kd_alpha) * ce
        else:
            loss = ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.time() - t0
        state["step"] += 1
        state["elapsed"] += dt
        state["tokens"] += x.numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if state["step"] % 25 == 0:
            tps = x.numel() / dt
            eta = (budget_s - state["elapsed"]) / 60
            log(f"{name} step {state['step']} loss {ema:.3f} (ce {ce.item():.3f}) lr {lr:.2e} "
                f"{tps:,.0f} tok/s tokens {state['tokens']:,} elapsed {state['elapsed'] / 60:.1f}m ETA {eta:.1f}m")
        now = time.time()
        if now - t_last_eval > eval_every_min * 60:
            evaluate()
            t_last_eval = time.time()
        if now - t_last_ckpt > ckpt_every_min * 60:
            save_ckpt()
            t_last_ckpt = time.time()
    evaluate()
    save_ckpt()
    export(name, model, tok, spec, state)
    return model


def init_from_teacher(model, teacher, layers: list):
    """Copy the teacher's embedding, final norm and the given decoder layers (same width)."""
    import torch
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight)
        model.model.norm.weight.copy_(teacher.model.norm.weight)
        for i, j in enumerate(layers):
            model.model.layers[i].load_state_dict(teacher.model.layers[j].state_dict())
    log(f"initialised from teacher layers {layers}")


def export(name: str, model, tok, spec: Spec, state: dict):
    """save_pretrained with fp16 weights on disk (half the size) and config dtype float32, so that a
    plain from_pretrained loads fp32 (CPU inference in fp16 is slow)."""
    import copy
    out = MODELS / name
    out.mkdir(parents=True, exist_ok=True)
    m16 = copy.deepcopy(model).half()
    m16.config.use_cache = True
    m16.save_pretrained(str(out), safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save_pretrained(str(out))
    info = {"name": name, "params": n_params(model), "layers": spec.layers, "hidden": spec.hidden,
            "heads": spec.heads, "intermediate": spec.intermediate, "train_tokens": state["tokens"],
            "train_minutes": round(state["elapsed"] / 60, 2), "steps": state["step"], "spec": asdict(spec),
            "heldout_at_end": state.get("heldout", {})}
    (out / "training.json").write_text(json.dumps(info, indent=2))
    log(f"exported {name} -> {out}")


def export_checkpoint(name: str):
    import torch
    from transformers import AutoTokenizer
    c = torch.load(CKPT / f"{name.replace('/', '_')}.pt", weights_only=False)
    spec = FAMILY[name]
    tok = AutoTokenizer.from_pretrained(str(DATA / "tokenizer"))
    model = make_model(spec, tok)
    model.load_state_dict(c["model"])
    export(name, model, tok, spec, c["state"])


def main(argv=None):
    ap = argparse.ArgumentParser(description="train the model family")
    ap.add_argument("--all", action="store_true", help="corpus + tokenizer + prompts + every model (target first)")
    ap.add_argument("--tokenizer", action="store_true", help="(re)build tokenizer, token arrays and prompt sets")
    ap.add_argument("--model", choices=list(FAMILY))
    ap.add_argument("--minutes", type=float, default=None, help="time budget (default: the model's own)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    ap.add_argument("--export", action="store_true", help="with --model: only export the checkpoint to models/")
    a = ap.parse_args(argv)
    if a.all:
        from modelzoo import corpus
        corpus.build(CORPUS)
    if a.all or a.tokenizer:
        from modelzoo import corpus
        d = train_tokenizer()
        tokenize_corpus(d)
        log("prompts:", corpus.write_prompts(CORPUS, MODELS / "prompts", d))
    if a.all:
        for name in FAMILY:  # target first: the distilled drafts need it
            train_model(name, a.minutes, a.threads, fresh=a.fresh)
    elif a.model and a.export:
        export_checkpoint(a.model)
    elif a.model:
        train_model(a.model, a.minutes, a.threads, fresh=a.fresh)
    elif not a.tokenizer:
        ap.error("nothing to do: give --all, --tokenizer or --model")


if __name__ == "__main__":
    main()

"""Offline corpus builder: English prose and Python code from Debian packages.

    python -m modelzoo.corpus --out data/corpus

Domains (one directory each under --out, with train.jsonl / heldout.jsonl,
one JSON object per document: {"id", "source", "text"}):

- prose: Jane Austen's six novels (r-cran-janeaustenr, R lazy-load data read
  by hand + the `rdata` package), one document per chapter; the King James
  Bible (bible-kjv-text, decoded with the `bible` reader from bible-kjv), one
  document per chapter.
- code:  the Python standard library source of this interpreter (no tests,
  no site-packages, no encodings tables), one document per file.
- docs:  the Python 3.11 documentation sources (python3.11-doc,
  _sources/*.rst.txt), one document per page. A third bucket: English prose
  about Python mixed with code; used for the tokenizer and reported in the
  model card, not part of the 50/50 training mix.

Held-out split: 3% of the documents of each domain, chosen by a hash of the
document id (stable across runs). Prompt sets for the benchmark are written
from the held-out splits by `write_prompts` (see there).
"""
from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import random
import re
import subprocess
import sys
import sysconfig
import warnings
import zlib
from pathlib import Path

HELDOUT_FRACTION = 0.03
DOMAINS = ("prose", "code", "docs")
DEBS = ("r-cran-janeaustenr", "bible-kjv-text", "bible-kjv", "python3.11-doc")

# Licenses of the sources, as recorded in each package's copyright file.
LICENSES = {
    "austen": ("Jane Austen's novels (public domain); packaged by janeaustenr (R package, MIT license), "
               "Debian r-cran-janeaustenr"),
    "kjv": ("King James Version (public domain; Crown patent in the UK); Debian bible-kjv-text / bible-kjv "
            "(GPL-2+ for the packaging/reader)"),
    "stdlib": "Python 3.11 standard library source, PSF License Agreement (Python Software Foundation License v2)",
    "pydocs": "Python 3.11 documentation sources, PSF License Agreement (Debian python3.11-doc)",
}


def _run(cmd, cwd=None):
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def fetch_debs(workdir: Path) -> dict[str, Path]:
    """apt-get download + dpkg-deb -x each package; returns pkg -> extracted root."""
    workdir.mkdir(parents=True, exist_ok=True)
    roots = {}
    for pkg in DEBS:
        root = workdir / f"x_{pkg}"
        if not root.exists():
            debs = glob.glob(str(workdir / f"{pkg}_*.deb"))
            if not debs:
                _run(["apt-get", "download", pkg], cwd=workdir)
                debs = glob.glob(str(workdir / f"{pkg}_*.deb"))
            root.mkdir()
            _run(["dpkg-deb", "-x", debs[0], str(root)])
        roots[pkg] = root
    return roots


# ----------------------------------------------------------------------------- sources
def read_austen(root: Path) -> list[dict]:
    """Austen novels from the R lazy-load database (Rdata.rdx index + Rdata.rdb blobs).

    .rdx is a gzip'd serialized R list {variables: name -> (offset, length)};
    each .rdb blob is a 4-byte big-endian length + zlib stream of a serialized
    character vector (one element per line of the novel)."""
    import rdata

    base = root / "usr/lib/R/site-library/janeaustenr/data/Rdata"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        index = rdata.conversion.convert(
            rdata.parser.parse_data(gzip.decompress((base.with_suffix(".rdx")).read_bytes())))
        blob = base.with_suffix(".rdb").read_bytes()
        docs = []
        for name, (off, length) in index["variables"].items():
            raw = zlib.decompress(blob[int(off) + 4:int(off) + int(length)])
            lines = [str(x) for x in rdata.conversion.convert(rdata.parser.parse_data(raw))]
            # split into chapters at lines like "CHAPTER I" / "Chapter 1"
            chapters, cur = [], []
            for line in lines:
                if re.match(r"^\s*(CHAPTER|Chapter)\s+[0-9IVXLC]+\.?\s*$", line) and cur:
                    chapters.append(cur)
                    cur = []
                cur.append(line)
            chapters.append(cur)
            for i, ch in enumerate(chapters):
                text = _unwrap("\n".join(ch)).strip()
                if len(text) > 200:
                    docs.append({"id": f"austen/{name}/{i:03d}", "source": "austen", "text": text})
    return docs


def _unwrap(text: str) -> str:
    """Join hard-wrapped lines into paragraphs (paragraphs separated by blank lines)."""
    paras = re.split(r"\n\s*\n", text)
    return "\n\n".join(" ".join(l.strip() for l in p.splitlines() if l.strip()) for p in paras if p.strip())


def read_kjv(text_root: Path, reader_root: Path) -> list[dict]:
    """KJV via the `bible` reader (-f: one 'Ge1:1 text' line per verse); one doc per chapter."""
    exe = reader_root / "usr/bin/bible"
    out = subprocess.run([str(exe), "-f", "-p", str(text_root / "usr/lib"), "Gen1:1-Rev22:21"],
                         check=True, capture_output=True, text=True, errors="replace").stdout
    chapters: dict[str, list[str]] = {}
    order = []
    for line in out.splitlines():
        m = re.match(r"^(\S+?)(\d+):(\d+)\s+(.*)$", line)
        if not m:
            continue
        key = f"{m.group(1)}{m.group(2)}"
        if key not in chapters:
            chapters[key] = []
            order.append(key)
        chapters[key].append(m.group(4).strip())
    return [{"id": f"kjv/{k}", "source": "kjv", "text": " ".join(chapters[k])} for k in order]


def read_stdlib() -> list[dict]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = re.compile(r"(^|/)(site-packages|test|tests|idle_test|encodings|pydoc_data|lib2to3/tests|__pycache__"
                      r"|config-[^/]*)(/|$)")
    docs = []
    for p in sorted(lib.rglob("*.py")):
        rel = p.relative_to(lib).as_posix()
        if skip.search(rel):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if 200 < len(text) < 400_000:
            docs.append({"id": f"stdlib/{rel}", "source": "stdlib", "text": text})
    return docs


def read_pydocs(root: Path) -> list[dict]:
    src = root / "usr/share/doc/python3.11/html/_sources"
    docs = []
    for p in sorted(src.rglob("*.rst.txt")):
        text = p.read_text(encoding="utf-8", errors="replace")
        if len(text) > 200:
            docs.append({"id": f"pydocs/{p.relative_to(src).as_posix()}", "source": "pydocs", "text": text})
    return docs


# ----------------------------------------------------------------------------- splits
def is_heldout(doc_id: str, fraction: float = HELDOUT_FRACTION) -> bool:
    h = int(hashlib.sha1(doc_id.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def write_jsonl(path: Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(l) for l in f if l.strip()]


def build(out: Path, workdir: Path | None = None) -> dict:
    workdir = workdir or out.parent / "debs"
    roots = fetch_debs(workdir)
    domains = {
        "prose": read_austen(roots["r-cran-janeaustenr"]) + read_kjv(roots["bible-kjv-text"], roots["bible-kjv"]),
        "code": read_stdlib(),
        "docs": read_pydocs(roots["python3.11-doc"]),
    }
    stats = {}
    for dom, docs in domains.items():
        train = [d for d in docs if not is_heldout(d["id"])]
        held = [d for d in docs if is_heldout(d["id"])]
        write_jsonl(out / dom / "train.jsonl", train)
        write_jsonl(out / dom / "heldout.jsonl", held)
        stats[dom] = {
            "train_docs": len(train), "heldout_docs": len(held),
            "train_chars": sum(len(d["text"]) for d in train), "heldout_chars": sum(len(d["text"]) for d in held),
            "sources": sorted({d["source"] for d in docs}),
        }
    stats["licenses"] = LICENSES
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    return stats


# ----------------------------------------------------------------------------- prompts
def _windows_by_tokens(text: str, tok, lo: int, hi: int, rng: random.Random, start_at_line: bool):
    """A prompt of lo..hi tokens cut from text at a random (line/word aligned) start."""
    if start_at_line:
        starts = [m.end() for m in re.finditer(r"\n", text)] or [0]
    else:
        starts = [0] + [m.end() for m in re.finditer(r"(?<=[.!?;:]) ", text)]
    for _ in range(20):
        s = rng.choice(starts)
        ids = tok.encode(text[s:s + hi * 12])
        if len(ids) < hi:
            continue
        n = rng.randint(lo, hi)
        piece = tok.decode(ids[:n])
        cut = max(piece.rfind(" "), piece.rfind("\n"))  # end on a word boundary, no trailing space
        if cut > 0 and len(tok.encode(piece[:cut])) >= lo:
            piece = piece[:cut]
        if piece.strip():
            return piece
    return None


def _repetition_score(text: str) -> float:
    """Fraction of word 3-grams that already occurred earlier in the text."""
    w = re.findall(r"\S+", text)
    seen, rep = set(), 0
    grams = [tuple(w[i:i + 3]) for i in range(len(w) - 2)]
    for g in grams:
        rep += g in seen
        seen.add(g)
    return rep / max(1, len(grams))


def write_prompts(corpus: Path, out: Path, tokenizer_dir: Path, seed: int = 0) -> dict:
    """prose.jsonl / code.jsonl: 64 prompts of 32-64 tokens each from the held-out splits
    (prose: half Austen, half KJV; cut to end on a word boundary);
    repetitive.jsonl: 32 prompts (~48-128 tokens) chosen for repeated structure (highest
    word-3-gram repetition among held-out windows of all domains: KJV genealogies, code with
    repeated lines, lists); long.jsonl: 16 prompts of 400-600 tokens (8 prose, 8 code)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rng = random.Random(seed)
    held = {d: read_jsonl(corpus / d / "heldout.jsonl") for d in DOMAINS}
    out.mkdir(parents=True, exist_ok=True)
    counts = {}

    def collect(docs, n, lo, hi, line):
        res, tries = [], 0
        docs = [d for d in docs if len(d["text"]) > hi * 8]
        by_src = {}
        for d in docs:  # sources in equal shares (Austen and KJV for prose)
            by_src.setdefault(d["source"], []).append(d)
        srcs = sorted(by_src)
        while len(res) < n and tries < n * 50:
            tries += 1
            src = srcs[len(res) % len(srcs)]
            p = _windows_by_tokens(rng.choice(by_src[src])["text"], tok, lo, hi, rng, line)
            if p and p not in res:
                res.append(p)
        return res

    sets = {
        "prose": collect(held["prose"], 64, 32, 64, False),
        "code": collect(held["code"], 64, 32, 64, True),
        "long": collect(held["prose"], 8, 400, 600, False) + collect(held["code"], 8, 400, 600, True),
    }
    # repetitive: scan windows, keep the most repetitive ones, at most 3 per document
    cands = []
    for dom in DOMAINS:
        for d in held[dom]:
            lines = d["text"].split("\n") if dom != "prose" else re.split(r"(?<=[.;:]) ", d["text"])
            step = 6
            for i in range(0, max(1, len(lines) - step), step):
                chunk = ("\n" if dom != "prose" else " ").join(lines[i:i + 14])
                if len(chunk) < 150:
                    continue
                ids = tok.encode(chunk)[:128]
                if len(ids) < 48:
                    continue
                piece = tok.decode(ids)
                cands.append((_repetition_score(piece), d["id"], piece))
    cands.sort(key=lambda c: -c[0])
    rep, per_doc = [], {}
    for _score, did, piece in cands:
        if per_doc.get(did, 0) >= 3:
            continue
        per_doc[did] = per_doc.get(did, 0) + 1
        rep.append(piece)
        if len(rep) == 32:
            break
    sets["repetitive"] = rep
    for name, prompts in sets.items():
        write_jsonl(out / f"{name}.jsonl", [{"prompt": p} for p in prompts])
        counts[name] = len(prompts)
    return counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/corpus")
    ap.add_argument("--workdir", default=None, help="where .debs are downloaded/extracted (default: <out>/../debs)")
    ap.add_argument("--prompts", default="models/prompts", help="prompt-set directory (written if a tokenizer exists)")
    ap.add_argument("--tokenizer", default="models/target")
    a = ap.parse_args(argv)
    stats = build(Path(a.out), Path(a.workdir) if a.workdir else None)
    print(json.dumps(stats, indent=2))
    if (Path(a.tokenizer) / "tokenizer.json").exists():
        print(write_prompts(Path(a.out), Path(a.prompts), Path(a.tokenizer)))
    else:
        print(f"no tokenizer at {a.tokenizer}: prompts are written by `python -m modelzoo.train --all`"
              " (or rerun this after the tokenizer exists)", file=sys.stderr)


if __name__ == "__main__":
    main()

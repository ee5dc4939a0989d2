"""`specdec-bench` console entry point."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, quick: bool = True):
        p.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder")
        p.add_argument("--models", type=Path, default=None, help="model family folder (default: models/)")
        p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
        p.add_argument("--reps", type=int, default=None, help="repetitions per measurement")
        p.add_argument("--k", type=int, default=4, help="fixed K of the speculative runs")
        if quick:
            p.add_argument("--quick", action="store_true", help="a smaller sweep (< 5 minutes here)")

    p = sub.add_parser("regimes", help="in-process sweep of every regime cell: plain vs fixed K vs auto")
    common(p)
    p.add_argument("--only", nargs="*", help="run only cells of these regimes or drafts")
    p.set_defaults(func=_regimes)

    p = sub.add_parser("peers", help="this engine vs HF generate / assisted generation on the same pair")
    common(p)
    p.add_argument("--draft", default="draft", help="draft model name under --models")
    p.set_defaults(func=_peers)

    p = sub.add_parser("predict", help="roofline regime map for H100/H200 and Llama pairs")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--context", type=int, default=512, help="KV context length")
    p.set_defaults(func=_predict)

    p = sub.add_parser("serve", help="load generator against a running OpenAI-compatible server")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--modes", nargs="*", default=["plain", "colocated", "separate", "auto"])
    p.add_argument("--rates", nargs="*", type=float, help="Poisson arrival rates (req/s); default closed loop")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompts", default="prose", help="prompt set under models/prompts")
    p.set_defaults(func=_serve)

    p = sub.add_parser("gpu", help="CUDA sweep: large random-init shapes, oracle draft of controlled acceptance")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batches", nargs="*", type=int, default=[1, 4, 16, 64, 128])
    p.add_argument("--acceptances", nargs="*", type=float, default=[0.5, 0.8, 0.95])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=1, help="interleaved plain/spec runs per point (median)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (small shapes: see BENCHMARKS.md)")
    p.set_defaults(func=_gpu)

    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.func(args)


def _emit(args, name: str, data: dict, markdown: str, plots=None) -> None:
    """Write NAME.json and NAME.md (and plots) under --out, and print the table."""
    from specdec_bench.report import write_json

    write_json(data, args.out / f"{name}.json")
    (args.out / f"{name}.md").write_text(markdown)
    paths = plots(data, args.out) if plots else []
    print(markdown)
    print(f"wrote {args.out / name}.json, {args.out / name}.md" + "".join(f", {p}" for p in paths))


def _regimes(args) -> None:
    from specdec_bench.regimes import run_regimes
    from specdec_bench.report import plot_regimes, regimes_markdown

    data = run_regimes(args)
    _emit(args, "regimes", data, regimes_markdown(data), plot_regimes)


def _peers(args) -> None:
    from specdec_bench.peers import peers_markdown, run_peers

    data = run_peers(args)
    _emit(args, "peers", data, peers_markdown(data))


def _predict(args) -> None:
    from specdec_bench.predict import predict_markdown, run_predict
    from specdec_bench.report import plot_predict

    data = run_predict(args)
    _emit(args, "predict", data, predict_markdown(data), plot_predict)


def _serve(args) -> None:
    from specdec_bench.load import run_serve, serve_markdown

    data = run_serve(args)
    _emit(args, "serve", data, serve_markdown(data))


def _gpu(args) -> None:
    from specdec_bench.gpu import gpu_markdown, run_gpu

    data = run_gpu(args)
    _emit(args, "regimes_gpu", data, gpu_markdown(data))


if __name__ == "__main__":
    main()

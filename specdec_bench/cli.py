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
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run with small shapes")
    p.set_defaults(func=_gpu)

    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.func(args)


def _regimes(args) -> None:
    from specdec_bench.regimes import run_regimes
    from specdec_bench.report import plot_regimes, regimes_markdown, write_json

    data = run_regimes(args)
    write_json(data, args.out / "regimes.json")
    (args.out / "regimes.md").write_text(regimes_markdown(data))
    paths = plot_regimes(data, args.out)
    print(f"wrote {args.out / 'regimes.json'}, {args.out / 'regimes.md'}, " + ", ".join(str(p) for p in paths))


def _peers(args) -> None:
    from specdec_bench.peers import peers_markdown, run_peers
    from specdec_bench.report import write_json

    data = run_peers(args)
    write_json(data, args.out / "peers.json")
    (args.out / "peers.md").write_text(peers_markdown(data))
    print(peers_markdown(data))


def _predict(args) -> None:
    from specdec_bench.predict import predict_markdown, run_predict
    from specdec_bench.report import plot_predict, write_json

    data = run_predict(args)
    write_json(data, args.out / "predict.json")
    (args.out / "predict.md").write_text(predict_markdown(data))
    paths = plot_predict(data, args.out)
    print(f"wrote {args.out / 'predict.json'}, {args.out / 'predict.md'}, " + ", ".join(str(p) for p in paths))


def _serve(args) -> None:
    from specdec_bench.load import run_serve, serve_markdown
    from specdec_bench.report import write_json

    data = run_serve(args)
    write_json(data, args.out / "serve.json")
    (args.out / "serve.md").write_text(serve_markdown(data))
    print(serve_markdown(data))


def _gpu(args) -> None:
    from specdec_bench.gpu import gpu_markdown, run_gpu
    from specdec_bench.report import write_json

    data = run_gpu(args)
    write_json(data, args.out / "regimes_gpu.json")
    (args.out / "regimes_gpu.md").write_text(gpu_markdown(data))
    print(gpu_markdown(data))


if __name__ == "__main__":
    main()

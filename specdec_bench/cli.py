"""`specdec-bench` console entry point."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


IN_PROCESS = ("regimes", "budget", "context", "peers", "overhead")  # the commands that load a model family here


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from specdec_bench.served_peers import DEFAULT_VLLM_MODES, OUR_MODES, OUR_SERVERS, VLLM_MODES

    def common(p, quick: bool = True):
        p.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder")
        p.add_argument("--models", type=Path, default=None, help="model family folder (default: models/dram-wide)")
        p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
        p.add_argument("--reps", type=int, default=None, help="repetitions per measurement")
        p.add_argument("--k", type=int, default=4, help="fixed K of the speculative runs")
        if quick:
            p.add_argument("--quick", action="store_true", help="a smaller sweep (< 5 minutes here on models/dram)")

    p = sub.add_parser("regimes", help="in-process sweep of every regime cell: plain vs fixed K vs auto")
    common(p)
    p.add_argument("--only", nargs="*", help="run only cells of these regimes or drafts")
    p.set_defaults(func=_regimes)

    p = sub.add_parser("budget", help="in-process batch sweep and mixed batches: budgeted verification vs "
                                      "plain, fixed K and auto")
    common(p, quick=False)
    p.add_argument("--batches", type=int, nargs="*", help="batch sizes (default 1 2 4 8 16 32 64)")
    p.add_argument("--only", nargs="*", help="cells whose name starts with one of these (e.g. mixed, 'prose b8')")
    p.add_argument("--max-new-tokens", type=int, help="every cell's mean output length (default 32; requests run "
                                                          "1/2 to 3/2 of it)")
    p.set_defaults(func=_budget)

    p = sub.add_parser("context", help="in-process batch x context grid: plain, fixed K with a full-KV and a "
                                       "bounded (sinks + window) draft, and auto")
    common(p, quick=False)
    p.add_argument("--batches", type=int, nargs="*", help="batch sizes (default 1 8 16)")
    p.add_argument("--contexts", type=int, nargs="*", help="prompt tokens per row (default 128 512 2000)")
    p.set_defaults(func=_context)

    p = sub.add_parser("peers", help="this engine vs HF generate / assisted generation on the same pair")
    common(p)
    p.add_argument("--draft", default="draft", help="draft model name under --models")
    p.add_argument("--served", action="store_true",
                   help="served instead: vLLM's CPU build (installed into .venv-vllm) and this project's server, "
                        "one at a time, the same load (--reps: repeats of the whole order)")
    p.add_argument("--families", nargs="*", default=["dram", "tiny"], help="with --served: model families")
    p.add_argument("--concurrency", nargs="*", type=int, default=[1, 4, 8, 16], help="with --served")
    p.add_argument("--requests", type=int, default=16, help="with --served: requests per pass (at least 2 x c)")
    p.add_argument("--max-tokens", type=int, default=48, help="with --served")
    p.add_argument("--prompts", default="prose", help="with --served: prompt set under models/prompts")
    p.add_argument("--reuse-prompts", action="store_true",
                   help="with --served: send the prompt set as it is, so passes repeat prompts and prefix caches "
                        "hit (by default each request's prompt starts with a number of its own: specdec_bench/load.py)")
    p.add_argument("--vllm-modes", nargs="*", default=list(DEFAULT_VLLM_MODES), choices=list(VLLM_MODES),
                   help="with --served: vLLM's modes (vllm-plain-no-prefix-cache: the ablation)")
    p.add_argument("--ours", nargs="*", default=["specdec"], choices=list(OUR_SERVERS),
                   help="with --served: this project's servers (specdec-no-prefix-cache: the ablation)")
    p.add_argument("--our-modes", nargs="*", default=list(OUR_MODES), choices=list(OUR_MODES),
                   help="with --served: this project's modes")
    p.set_defaults(func=_peers)

    p = sub.add_parser("predict", help="roofline predictions: one configuration, the regime map, or the "
                                         "published measurements (--published)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--context", type=int, default=512, help="KV context length (cached tokens per row)")
    p.add_argument("--published", action="store_true",
                   help="predicted vs published points (SpecDecode-Bench; a vLLM V1 serving sweep)")
    p.add_argument("--target-config", help="HF config.json of the target: one configuration instead of the map")
    p.add_argument("--draft-config", help="HF config.json of the draft")
    p.add_argument("--device", choices=["a100", "h100", "h200"], default="h100")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (draft and target alike)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp8"], default="bf16", help="weight dtype")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=None, help="fixed K (the map's default: 3)")
    given = p.add_mutually_exclusive_group()
    given.add_argument("--acceptance", type=float, help="per-token acceptance rate a")
    given.add_argument("--tau", type=float, help="mean tokens per target pass (accepted drafts + bonus)")
    p.add_argument("--json", action="store_true", help="print one configuration's answer as one JSON object")
    p.set_defaults(func=_predict)

    p = sub.add_parser("serve", help="load generator against a running OpenAI-compatible server")
    _server_load_args(p)
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--modes", nargs="*", default=["plain", "colocated", "separate", "auto"],
                   help="plain, colocated, separate, auto; colocated:K or separate:K for a fixed K")
    p.add_argument("--rates", nargs="*", type=float, help="Poisson arrival rates (req/s); default closed loop")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--user", default=None, help="OpenAI `user` of every request (its traffic class)")
    p.add_argument("--mix", nargs="*", metavar="SET:T[:USER]",
                   help="a mixed load: request i is profile i mod n (prompt set, temperature, user), e.g. "
                        "prose:0 prose:1:sampler code:0:coder (in place of --prompts/--temperature/--user)")
    p.add_argument("--interleave", action="store_true",
                   help="modes take turns round by round on the same prompts (auto first)")
    p.add_argument("--round-requests", type=int, default=None,
                   help="with --interleave: requests per mode per round (default 4 x concurrency; "
                        "= concurrency: each round is one burst)")
    p.set_defaults(func=_serve)

    p = sub.add_parser("metrics", help="a real Prometheus against a running server: every dashboard panel has "
                                       "data, the counters agree with the responses")
    _server_load_args(p)
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the mixed traffic runs")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prometheus", default="prometheus",
                   help="the Prometheus binary (Debian: apt-get install prometheus)")
    p.add_argument("--config", default=str(ROOT / "deploy" / "prometheus" / "prometheus.yml"))
    p.add_argument("--dashboard", default=str(ROOT / "deploy" / "grafana" / "specdec-serve.json"))
    p.add_argument("--ray-temp", default="/tmp/ray", help="the Ray cluster's --temp-dir (service discovery file)")
    p.set_defaults(func=_metrics)

    p = sub.add_parser("overhead", help="in-process engine vs a running server, same prompts, alternating runs")
    _server_load_args(p)
    p.add_argument("--target", type=Path, default=None, help="default: the shipped target")
    p.add_argument("--draft", type=Path, default=None, help="default: the shipped draft")
    p.add_argument("--modes", nargs="*", default=["plain", "colocated"], choices=["plain", "colocated"])
    p.add_argument("--concurrency", nargs="*", type=int, default=[1, 8])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--k", type=int, default=4, help="K of co-located speculation (the server's default_k)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in-process (a replica's torch_threads)")
    p.add_argument("--reps", type=int, default=3, help="alternating in-process/served runs per cell (medians)")
    p.set_defaults(func=_overhead)

    p = sub.add_parser("faults", help="mixed load on a running server while random replicas are killed")
    _server_load_args(p)
    p.add_argument("--app", default="specdec", help="the Serve application's name (finds its replicas)")
    p.add_argument("--minutes", type=float, default=10.0, help="the measured window")
    p.add_argument("--warmup", type=float, default=120.0,
                   help="seconds of load before the window (and a replacement replica's own warm-up)")
    p.add_argument("--kill-every", type=float, default=120.0, help="seconds between kills")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="which replicas (and nodes) go")
    p.add_argument("--nodes", action="store_true",
                   help="start --config's app on a head and two worker nodes of this machine (not --url) and "
                        "remove worker nodes as well")
    p.add_argument("--config", default=str(ROOT / "serve_config.yaml"), help="with --nodes: the app to start")
    p.add_argument("--node-every", type=float, default=180.0, help="with --nodes: seconds between node removals")
    p.add_argument("--node-down", type=float, default=20.0, help="with --nodes: seconds a removed node stays away")
    p.set_defaults(func=_faults)

    p = sub.add_parser("autoscale", help="the plain pool autoscaled across the nodes of a local multi-node "
                                         "cluster under a load step")
    _server_load_args(p)
    p.add_argument("--app", default="specdec", help="the Serve application's name")
    p.add_argument("--config", default=str(ROOT / "serve_config.yaml"), help="the app to start")
    p.add_argument("--low", type=int, default=1, help="concurrency before and after the step")
    p.add_argument("--high", type=int, default=8, help="concurrency during the step")
    p.add_argument("--before", type=float, default=30.0, help="seconds at --low before the step")
    p.add_argument("--step", type=float, default=90.0, help="seconds at --high")
    p.add_argument("--after", type=float, default=60.0, help="seconds at --low after the step")
    p.add_argument("--target-ongoing", type=float, default=4.0, help="sequences per plain replica the policy aims at")
    p.add_argument("--up-delay", type=float, default=5.0, help="seconds a wish to scale up must hold")
    p.add_argument("--down-delay", type=float, default=20.0, help="seconds a wish to scale down must hold")
    p.add_argument("--temperature", type=float, default=0.0)
    p.set_defaults(func=_autoscale)

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
    if args.command in IN_PROCESS:
        from modelzoo.grow import build_missing
        from specdec_bench.common import MODELS_DIR

        for built in build_missing(getattr(args, "models", None) or MODELS_DIR):  # a family kept as recipes
            print(f"built {built}")
    args.func(args)


def _server_load_args(p) -> None:
    """What every benchmark against a running server takes: where, what to send, where to write."""
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompts", default="prose", help="prompt set under models/prompts")
    p.add_argument("--reuse-prompts", action="store_true",
                   help="send the prompt set as it is, so prefix caches hit on repeats (by default each request's "
                        "prompt starts with a number of its own: specdec_bench/load.py)")


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


def _budget(args) -> None:
    from specdec_bench.budget import budget_markdown, run_budget

    data = run_budget(args)
    _emit(args, "budget", data, budget_markdown(data))


def _context(args) -> None:
    from specdec_bench.context import context_markdown, run_context

    data = run_context(args)
    _emit(args, "context", data, context_markdown(data))


def _peers(args) -> None:
    if args.served:
        from specdec_bench.report import plot_served_peers
        from specdec_bench.served_peers import run_served_peers, served_peers_markdown

        args.repeats = args.reps or 1
        data = run_served_peers(args)
        _emit(args, "peers_served", data, served_peers_markdown(data), plot_served_peers)
        return
    from specdec_bench.peers import peers_markdown, run_peers

    data = run_peers(args)
    _emit(args, "peers", data, peers_markdown(data))


def _predict(args) -> None:
    from specdec_bench import predict

    if args.target_config:
        if not (args.draft_config and args.k and (args.acceptance is not None or args.tau is not None)):
            raise SystemExit("one configuration needs --draft-config, --k and --acceptance or --tau")
        data = predict.predict_one(args)
        print(json.dumps(data) if args.json else predict.one_markdown(data))
    elif args.published:
        data = predict.run_published()
        _emit(args, "predict_published", data, predict.run_published_markdown(data))
    else:
        from specdec_bench.report import plot_predict

        data = predict.run_predict(args)
        _emit(args, "predict", data, predict.predict_markdown(data), plot_predict)


def _overhead(args) -> None:
    from specdec_bench.overhead import overhead_markdown, run_overhead

    data = run_overhead(args)
    _emit(args, "overhead", data, overhead_markdown(data))


def _faults(args) -> None:
    from specdec_bench.faults import faults_markdown, run_faults

    data = run_faults(args)
    _emit(args, "faults", data, faults_markdown(data))


def _autoscale(args) -> None:
    from specdec_bench.autoscale import autoscale_markdown, run_autoscale

    data = run_autoscale(args)
    _emit(args, "autoscale", data, autoscale_markdown(data))


def _metrics(args) -> None:
    from specdec_bench.metrics_check import metrics_markdown, run_metrics_check

    data = run_metrics_check(args)
    _emit(args, "metrics", data, metrics_markdown(data))
    if not data["passed"]:
        raise SystemExit("metrics check failed: see the table above")


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

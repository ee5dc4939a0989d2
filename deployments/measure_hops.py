"""Per-step orchestration overhead of the separate topology at batch 1, against the co-located path.

    PYTHONPATH=. python -m deployments.measure_hops            # random-init models
    PYTHONPATH=. python -m deployments.measure_hops --target models/target --draft models/draft

Starts a local cluster and the app, sends greedy streamed requests with a fixed K one at a time to
each path (plain, co-located, separate), and times decoding at the client: from the first chunk (the
prefill's) to the last, per token after the first. Each request's final chunk says how many steps it
took. Greedy output and K are the same on both speculative paths, so without overlap (the default,
``--overlap never``) they take the same steps: the separate topology's per-step orchestration
overhead is the difference in time per token times its tokens per step. With overlap the
difference also holds the draft time that overlap hides. Also times a bare handle call (driver ->
Target replica) for reference, and reports the router's overlap counters.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _random_models(root: Path, target_layers: int, draft_layers: int, hidden: int) -> dict:
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_model, build_tokenizer  # the test suite's tiny-model builder

    tok = build_tokenizer(str(root / "tokenizer"))
    return {"target": build_model(str(root / "target"), tok, target_layers, 0, hidden),
            "draft": build_model(str(root / "draft"), tok, draft_layers, 1, hidden)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--target-layers", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--overlap", choices=("auto", "always", "never"), default="never",
                    help="separate_overlap (default never: the orchestration overhead alone)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import httpx
    import ray
    from ray import serve

    from deployments.app import build_app

    tmp = tempfile.mkdtemp(prefix="hops-")
    models = ({"target": args.target, "draft": args.draft} if args.target else
              _random_models(Path(tmp), args.target_layers, args.draft_layers, args.hidden))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        extra = {"separate_overlap": args.overlap}
        serve.run(build_app({**models, **extra, "max_model_len": 512, "router": {"num_cpus": 0.1},
                             "plain": {"num_cpus": 0.1}, "colocated": {"num_cpus": 0.1},
                             "draft_deployment": {"num_cpus": 0.1}, "target_deployment": {"num_cpus": 0.1}}),
                  name="hops", route_prefix="/")
        paths = {
            "plain": {"mode": "plain"},
            "colocated": {"mode": "speculative", "topology": "colocated", "num_speculative_tokens": args.k},
            "separate": {"mode": "speculative", "topology": "separate", "num_speculative_tokens": args.k},
        }
        results = {}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
            for name, spec in paths.items():
                decode_s, decode_tokens, steps, tokens = 0.0, 0, 0, 0
                for r in range(args.requests + 1):  # the first request warms up
                    body = {"prompt": f"It is a truth universally acknowledged {r}", "max_tokens": args.max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
                            "speculation": spec}
                    arrivals, ntok, last = [], [], None
                    with c.stream("POST", "/v1/completions", json=body) as resp:
                        for line in resp.iter_lines():
                            if line.startswith("data: {"):
                                chunk = json.loads(line[6:])
                                if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                                    arrivals.append(time.perf_counter())
                                    ntok.append(len(chunk["choices"][0]["token_ids"]))
                                last = chunk.get("speculation") or last
                    if r > 0:
                        decode_s += arrivals[-1] - arrivals[0]
                        decode_tokens += sum(ntok[1:])
                        steps += last["verify_steps"] + last["plain_steps"]
                        tokens += sum(ntok)
                results[name] = {
                    "steps": steps,
                    "tokens_per_step": tokens / steps,
                    "ms_per_token": 1e3 * decode_s / decode_tokens,  # after the first chunk (the prefill's)
                }
        target = serve.get_deployment_handle("Target", "hops")
        target.where.remote("ping").result()
        pings = []
        for _ in range(50):
            t = time.perf_counter()
            target.options(session_id="ping").where.remote("ping").result()
            pings.append(time.perf_counter() - t)
        results["handle_call_driver_to_target_ms"] = 1e3 * statistics.median(pings)
        sep, col = results["separate"], results["colocated"]
        results["separate_step_overhead_ms"] = (sep["ms_per_token"] - col["ms_per_token"]) * sep["tokens_per_step"]
        router = serve.get_deployment_handle("Router", "hops").pool_stats.remote().result()["router"]
        results["separate_overlap_rounds"] = router["separate_overlap"]
        results["models"] = models
        results["k"] = args.k
        results["separate_overlap"] = args.overlap
        print(json.dumps(results, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()

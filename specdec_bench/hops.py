"""Per-step orchestration overhead of the separate topology at batch 1, against the co-located path.

    python -m specdec_bench.hops            # random-init models
    python -m specdec_bench.hops --target models/target --draft models/draft

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
import statistics
import tempfile
import time
from pathlib import Path

from specdec_bench.local_app import running_app, sse_event


def _random_models(root: Path, target_layers: int, draft_layers: int, hidden: int) -> dict:
    from modelzoo.random_init import build_model, build_tokenizer

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

    import httpx
    from ray import serve

    tmp = tempfile.mkdtemp(prefix="hops-")
    models = ({"target": args.target, "draft": args.draft} if args.target else
              _random_models(Path(tmp), args.target_layers, args.draft_layers, args.hidden))
    small = {"num_cpus": 0.1}
    app_args = {**models, "separate_overlap": args.overlap, "max_model_len": 512, "router": small, "plain": small,
                "colocated": small, "draft_deployment": small, "target_deployment": small}
    with running_app(app_args, "hops") as app:
        paths = {
            "plain": {"mode": "plain"},
            "colocated": {"mode": "speculative", "topology": "colocated", "num_speculative_tokens": args.k},
            "separate": {"mode": "speculative", "topology": "separate", "num_speculative_tokens": args.k},
        }
        results = {}
        with httpx.Client(base_url=app["url"], timeout=300) as c:
            for name, spec in paths.items():
                decode_s, decode_tokens, steps, tokens = 0.0, 0, 0, 0
                for r in range(args.requests + 1):  # the first request warms up
                    body = {"prompt": f"It is a truth universally acknowledged {r}", "max_tokens": args.max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
                            "speculation": spec}
                    arrivals, ntok, last = [], [], None
                    with c.stream("POST", "/v1/completions", json=body) as resp:
                        for chunk in map(sse_event, resp.iter_lines()):
                            if isinstance(chunk, dict):
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


if __name__ == "__main__":
    main()

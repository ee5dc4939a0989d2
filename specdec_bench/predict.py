"""`specdec-bench predict`: the roofline cost model's regime map for hardware and model pairs we
do not have: best-K speedup over (batch size x acceptance) and the break-even batch per
acceptance, per (device, target/draft) scenario."""

from __future__ import annotations

from specdec_core.costmodel import H100, H200, CostModel, llama3_8b, llama3_70b, llama32_1b, roofline_costs

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ACCEPTANCES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
PAIRS = {
    "Llama-3-8B + Llama-3.2-1B": (llama3_8b, llama32_1b),
    "Llama-3-70B + Llama-3-8B": (llama3_70b, llama3_8b),
}


def run_predict(args) -> dict:
    scenarios = []
    for device in (H100, H200):
        for pair, (target, draft) in PAIRS.items():
            costs = roofline_costs(target, draft, device, BATCHES, (1, 2, 3, 4, 5, 6, 7, 8, 9),
                                   context_len=args.context)
            model = CostModel(costs)
            grid, ks, break_even = [], [], {}
            for a in ACCEPTANCES:
                choices = [model.best_k(b, a, k_max=8) for b in BATCHES]
                grid.append([round(c.predicted_speedup, 3) for c in choices])
                ks.append([c.k for c in choices])
                plain_from = next((b for b, c in zip(BATCHES, choices) if c.k == 0), None)
                break_even[str(a)] = plain_from
            scenarios.append({
                "name": f"{device.name} {pair}",
                "device": device.name,
                "pair": pair,
                "speedup": grid,
                "best_k": ks,
                "break_even_batch": break_even,
                "cost_ratio_b1": model.cost_ratio(1),
            })
    return {"batches": list(BATCHES), "acceptances": list(ACCEPTANCES), "context_len": args.context,
            "scenarios": scenarios}


def predict_markdown(data: dict) -> str:
    lines = ["# Predicted regime map (roofline cost model)", "",
             f"Context length {data['context_len']}; best K in 1..8 or plain; speedup = plain / best time per token.",
             ""]
    for s in data["scenarios"]:
        lines += [f"## {s['name']} (cost ratio at batch 1: {s['cost_ratio_b1']:.3f})", "",
                  "| a \\ batch | " + " | ".join(str(b) for b in data["batches"]) + " |",
                  "|---" * (len(data["batches"]) + 1) + "|"]
        for a, row, ks in zip(data["acceptances"], s["speedup"], s["best_k"]):
            lines.append(f"| {a} | " + " | ".join(f"{v:.2f} (K={k})" for v, k in zip(row, ks)) + " |")
        lines += ["", "Break-even batch (first batch where plain wins): "
                  + ", ".join(f"a={a}: {b}" for a, b in s["break_even_batch"].items()), ""]
    return "\n".join(lines) + "\n"

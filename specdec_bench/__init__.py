"""specdec-bench: measure where speculative decoding pays and where it hurts, side by side with
what the cost model predicts (subcommands: regimes, serve, predict, peers)."""

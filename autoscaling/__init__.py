"""Routing and scaling policies: pure functions over a context and a state.

`routing` decides which pool serves a request and with which K; `scaling` is the
Ray Serve autoscaling policy for a pool. Nothing is imported here, so loading
`autoscaling.scaling` (Serve's controller, the `serve` CLI) does not pull in
the engine.
"""

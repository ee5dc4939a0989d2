"""Ray Serve layer: the engine replica pools, the separate topology's Draft and Target, the
session-affinity request router, the OpenAI-compatible ingress and the app builder
(``deployments.app:build_app``, named by serve_config.yaml)."""

"""deploy/kuberay/rayservice.yaml stays the service serve_config.yaml describes: its serveConfigV2 is
serve_config.yaml's application with the placement of README "Placement across nodes" (each
deployment asks for its worker group's custom resource), HTTP on every interface of the head pod
and the proxy on the head only; every resource a deployment asks for is one a worker group offers."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kuberay" / "rayservice.yaml"
PLACEMENT = {"router": "head_node", "plain": "pool_node", "colocated": "pool_node", "draft_deployment": "draft_node",
             "target_deployment": "target_node"}


def expected_serve_config() -> dict:
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    apps = copy.deepcopy(cfg["applications"])
    for deployment, resource in PLACEMENT.items():
        apps[0]["args"][deployment]["resources"] = {resource: 0.01}
    return {"proxy_location": "HeadOnly", "http_options": {"host": "0.0.0.0", "port": cfg["http_options"]["port"]},
            "logging_config": cfg["logging_config"], "applications": apps}


def test_rayservice_serves_what_serve_config_describes():
    manifest = yaml.safe_load(MANIFEST.read_text())
    got = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    want = expected_serve_config()
    assert got == want, "regenerate serveConfigV2 of deploy/kuberay/rayservice.yaml:\n" + yaml.safe_dump(
        want, sort_keys=False)
    cluster = manifest["spec"]["rayClusterConfig"]
    offered = set()
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        offered |= set(json.loads(json.loads(group["rayStartParams"]["resources"])))
    assert set(PLACEMENT.values()) <= offered


def test_the_manifests_app_config_is_valid():
    from deployments.config import AppConfig

    got = yaml.safe_load(yaml.safe_load(MANIFEST.read_text())["spec"]["serveConfigV2"])
    AppConfig(**got["applications"][0]["args"])  # the builder's own validation

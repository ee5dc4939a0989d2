"""The Ray Serve app end to end: one local Ray cluster and one Serve app (plain, co-located and
separate paths, two Target replicas) on the tiny models, shared by every test in this package (torn
down after its last test, before the other cluster tests start clusters of their own). HTTP goes to
127.0.0.1 on a free port, with httpx and with the official openai client."""

from __future__ import annotations

import os

import httpx
import pytest
from served import (
    EOS_AT,
    EOS_PROMPT,
    HEADER_TIMEOUT_S,
    app_args,
    complete,
    free_port,
    greedy_ids,
    running_app,
    synthetic_costs,
)


def with_extra_eos(target: str, tmp_path_factory) -> str:
    import shutil

    from transformers import GenerationConfig

    ids = greedy_ids(target, EOS_PROMPT, EOS_AT + 1)
    assert ids[EOS_AT] not in ids[:EOS_AT]
    path = str(tmp_path_factory.mktemp("eos") / "target")
    shutil.copytree(target, path)
    config = GenerationConfig.from_pretrained(path)
    config.eos_token_id = [config.eos_token_id, ids[EOS_AT]]
    config.save_pretrained(path)
    return path


@pytest.fixture(scope="package")
def server(tiny_models, tmp_path_factory):
    from deployments.calibrate import record, save_calibration

    models = {**tiny_models, "target": with_extra_eos(tiny_models["target"], tmp_path_factory)}
    calibration = str(tmp_path_factory.mktemp("calibration") / "calibration.json")
    save_calibration(calibration, record(synthetic_costs(), models["target"], models["draft"], "cpu"))
    metrics_port = free_port()
    # read by the proxy processes this cluster starts
    os.environ["SPECDEC_HTTP_HEADER_TIMEOUT_S"] = str(HEADER_TIMEOUT_S)
    try:
        with running_app(app_args(models, calibration), metrics_port=metrics_port) as app:
            # the app's first request, sent the moment it answers: whichever test runs first, one sees it
            with httpx.Client(base_url=app["url"], timeout=120) as c:
                first = complete(c, user="first-request")
            yield {**app, "target": models["target"], "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics",
                   "first_response": first}
    finally:
        del os.environ["SPECDEC_HTTP_HEADER_TIMEOUT_S"]


@pytest.fixture(scope="package")
def client(server):
    with httpx.Client(base_url=server["url"], timeout=120) as c:
        yield c

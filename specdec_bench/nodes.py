"""Several Ray nodes on this machine serving the app (issue 38): ``ray.cluster_utils.Cluster`` gives each
node its own raylet, object store and worker processes, so removing one is a node's loss (every
replica on it gone at once), not a replica crash. One copy for the multi-node test and the
benchmarks (`specdec-bench faults --nodes`, `specdec-bench autoscale`).

Placement, by custom resources from the app's config (README, "Placement across nodes"):

| node   | resources                       | holds                                                 |
|--------|---------------------------------|-------------------------------------------------------|
| head   | head_node                       | Serve's controller, the one HTTP proxy, the routers,  |
|        |                                 | the co-located pool                                   |
| a      | target_node, plain_slot         | the Target, one plain replica                         |
| b      | draft_node, plain_slot          | the Draft, one plain replica                          |

A plain replica takes a whole ``plain_slot``, so two plain replicas (or an autoscaled second one)
land on two nodes; the separate topology's channels cross from a to b. The proxy runs on the head only
(``HeadOnly``): every node's proxy would bind the same port on this one machine, and a stream through
the proxy of a node that goes is cut with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from specdec_bench.local_app import serving_environment, start_serve_on_a_free_port

WORKERS = {"a": {"target_node": 1.0, "plain_slot": 1.0}, "b": {"draft_node": 1.0, "plain_slot": 1.0}}
HEAD_RESOURCES = {"head_node": 1.0}
OBJECT_STORE_BYTES = 256 << 20  # per node: the app moves token ids, not tensors, through it


def placement(args: dict, plain_replicas: int = 2, routers: int = 2, num_cpus: float = 0.1) -> dict:
    """``args`` (the app's) with every deployment placed as in the table above."""
    on = lambda resource, amount=0.01: {"num_cpus": num_cpus, "resources": {resource: amount}}  # noqa: E731
    plain = {**args.get("plain", {}), **on("plain_slot", 1.0), "num_replicas": plain_replicas}
    return {**args, "router": {**on("head_node"), "num_replicas": routers},
            "colocated": {**args.get("colocated", {}), **on("head_node")}, "plain": plain,
            "draft_deployment": on("draft_node"), "target_deployment": on("target_node")}


@dataclass
class Nodes:
    """The cluster's worker nodes by name; a removed one can come back with the same resources."""

    cluster: object  # ray.cluster_utils.Cluster
    worker_cpus: float
    workers: dict = field(default_factory=dict)  # name -> ray._private.node.Node

    def add(self, name: str) -> None:
        self.workers[name] = self.cluster.add_node(num_cpus=self.worker_cpus, resources=WORKERS[name],
                                                   object_store_memory=OBJECT_STORE_BYTES)
        self.cluster.wait_for_nodes()

    def remove(self, name: str) -> None:
        """The node's raylet, object store and every process on it, at once."""
        self.cluster.remove_node(self.workers.pop(name))

    def name_of(self, node_id: str) -> str:
        return next((n for n, node in self.workers.items() if node.node_id == node_id), "head")


def replica_nodes(app: str, deployment: str) -> list[str]:
    """Node ids of ``deployment``'s live replicas (one per replica)."""
    from ray.util.state import list_actors

    return [a.node_id for a in list_actors(filters=[("class_name", "=", f"ServeReplica:{app}:{deployment}"),
                                                    ("state", "=", "ALIVE")])]


@contextlib.contextmanager
def running_cluster_app(args: dict, app: str, head_cpus: float = 2, worker_cpus: float = 1) -> Iterator[dict]:
    """A head and the workers of ``WORKERS`` on this machine serving ``build_app(args)`` (place it
    with ``placement``) as ``app`` on a free 127.0.0.1 port, all shut down on exit:
    {"url", "nodes": Nodes, "router"}."""
    serving_environment()
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import build_app

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "resources": HEAD_RESOURCES, "object_store_memory": OBJECT_STORE_BYTES})
    nodes = Nodes(cluster, worker_cpus)
    try:
        for name in WORKERS:
            nodes.add(name)
        ray.init(address=cluster.address, log_to_driver=False)
        port = start_serve_on_a_free_port(proxy_location="HeadOnly")
        serve.run(build_app(args), name=app, route_prefix="/")
        yield {"url": f"http://127.0.0.1:{port}", "nodes": nodes, "router": serve.get_deployment_handle("Router", app)}
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        cluster.shutdown()

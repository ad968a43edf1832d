"""A multi-node Ray cluster on one machine for the fault tests (Ray's own `ray.cluster_utils.Cluster`).

    with local_cluster({"trainer": 3, "teacher": 2}) as nodes:   # node kinds -> how many
        ...                        # ray is connected; a test kills nodes, nodes.replace_dead() refills

Each node is its own raylet (with its own object store) with 1 CPU and one unit of its kind's custom
resource, so a test pins train workers (`ray.resources_per_worker: {trainer: 1}`) and teacher replicas
(`teacher.pool.resources: {teacher: 1}`) to nodes it can lose; the head holds no CPU. Health checks are
fast (a dead node is noticed in about a second instead of Ray's default ~15 s). Serve and the cluster
are always torn down, whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

# the addresses a port bound to the loopback shows (an IPv4 one, seen through a dual-stack socket, or IPv6's)
LOOPBACK = frozenset({"127.0.0.1", "::ffff:127.0.0.1", "::1"})


def listening_ports(itself: bool = True) -> set[tuple[str, int, str]]:
    """(address, port, "pid N: command") of every TCP port this process (unless `itself` is false) and its
    descendants (a local Ray's processes) listen on."""
    import psutil

    me = psutil.Process()
    procs = {p.pid: p for p in [*([me] if itself else []), *me.children(recursive=True)]}
    found = set()
    for c in psutil.net_connections("tcp"):
        if c.status == "LISTEN" and c.pid in procs:
            try:
                name = " ".join(procs[c.pid].cmdline()[:3])[:120]
            except psutil.Error:
                name = "?"
            found.add((c.laddr.ip, c.laddr.port, f"pid {c.pid}: {name}"))
    return found


FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 300,
                      "health_check_failure_threshold": 3, "health_check_timeout_ms": 1000}


class Nodes:
    def __init__(self, cluster: Any, kinds: dict[str, int]) -> None:
        self.cluster = cluster
        self.kinds = dict(kinds)
        self.nodes: list[tuple[Any, str]] = []
        for kind, n in kinds.items():
            for _ in range(n):
                self.add(kind)
        cluster.wait_for_nodes()

    def add(self, kind: str) -> Any:
        node = self.cluster.add_node(num_cpus=1, resources={kind: 1})
        self.nodes.append((node, kind))
        return node

    def dead(self) -> list[tuple[Any, str]]:
        def gone(node: Any) -> bool:
            raylet = node.all_processes.get("raylet")
            return not raylet or raylet[0].process.poll() is not None

        return [(n, k) for n, k in self.nodes if gone(n)]

    def replace_dead(self, timeout_s: float = 60.0) -> list[str]:
        """Reap every node a test killed and start a fresh one of its kind; returns the kinds replaced."""
        replaced = []
        for node, kind in self.dead():
            self.cluster.remove_node(node, allow_graceful=False)
            self.nodes.remove((node, kind))
            self.add(kind)
            replaced.append(kind)
        # returns once the GCS has marked the dead ones dead and registered the new ones
        self.cluster.wait_for_nodes(timeout_s)
        return replaced


@contextlib.contextmanager
def local_cluster(kinds: dict[str, int], env: dict[str, str] | None = None) -> Iterator[Nodes]:
    """`env`: more environment for every Ray process of the cluster (e.g. a test S3 server's credentials)."""
    import ray
    from ray.cluster_utils import Cluster

    from hylo.pipeline.ray_init import project_env

    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update({**project_env(), **(env or {})})
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False,
                                      "_system_config": FAST_HEALTH_CHECKS})
    try:
        yield Nodes(cluster, kinds)
    finally:
        try:
            if ray.is_initialized():
                from ray import serve

                serve.shutdown()
        except Exception as e:  # noqa: BLE001 - teardown goes on whatever Serve says
            print(f"[cluster] serve.shutdown: {e}")
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

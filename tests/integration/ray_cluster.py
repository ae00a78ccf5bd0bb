"""A real two-node Ray cluster on loopback for the Ray backend's tests.

Two raylets on 127.0.0.1 (``ray.cluster_utils.Cluster``), each with its own custom
resource so a test can tell the nodes apart and give a stage room on both. Node health
checks run every 0.5 s, so a killed node is declared dead within about a second.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

NODE_ARGS: dict[str, Any] = {
    "node_ip_address": "127.0.0.1",
    "object_store_memory": 80 * 1024 * 1024,
}


@contextmanager
def two_node_cluster(slots: float = 2, cpus: int = 2) -> Iterator[tuple[Any, Any]]:
    """(cluster, worker node): the head node offers ``{"slot": slots, "node_a": 1}``, the
    worker ``{"slot": slots, "node_b": 1}``."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            **NODE_ARGS,
            "num_cpus": cpus,
            "resources": {"slot": slots, "node_a": 1},
            "include_dashboard": False,
            "_system_config": {
                "health_check_period_ms": 500,
                "health_check_failure_threshold": 2,
                "worker_niceness": 0,
            },
        },
    )
    try:
        worker = cluster.add_node(
            **NODE_ARGS, num_cpus=cpus, resources={"slot": slots, "node_b": 1}
        )
        cluster.wait_for_nodes()
        yield cluster, worker
    finally:
        cluster.shutdown()


def replica_host_pids() -> list[int]:
    """Processes of omnistage's Ray actors (Ray titles them ``ray::ReplicaHost``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if re.match(rb"ray::ReplicaHost", cmdline):
            pids.append(int(entry.name))
    return pids


def parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])

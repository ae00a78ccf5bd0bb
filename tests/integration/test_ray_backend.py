"""``--worker-backend ray`` on a real two-node Ray cluster (two raylets on loopback).

The head joins the cluster with --ray-address; every replica is a Ray actor placed from
its stage's ``ray:`` resources. Checked: replicas spread over both nodes and show their
node; a killed actor and a lost node lose no request and the stage gets back to its
replica count on the node that has room; a headless replica joins a Ray-backed head;
shutdown leaves no actor behind.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import HeadProc, SteadyLoad, headless, wait_for
from tests.integration.ray_cluster import parent_pid, replica_host_pids, two_node_cluster

pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
# Ray's tests run on one pytest-xdist worker, one after another: each starts a Ray
# cluster, and replica_host_pids() counts every Ray actor on the machine.
pytestmark = pytest.mark.xdist_group("ray")

CONFIG = """
pipeline: echo-ray
stages:
  - stage_id: 0
    name: thinker
    engine: echo
    engine_args: {num_chunks: 4}
    ray: {num_cpus: 0.1}
  - stage_id: 1
    name: talker
    engine: echo
    engine_args: {num_chunks: 8, chunk_delay_s: 0.03}
    inputs: [0]
    replicas: 2
    ray: {num_cpus: 0.1, resources: {slot: 1}, placement: spread}
    final_output: true
"""


def _expected(text: str) -> str:
    return f"{text} [thinker] [talker]"


@pytest.fixture
def cluster() -> Iterator[tuple[Any, Any]]:
    with two_node_cluster() as c:
        yield c


def _start(tmp: Path, address: str, *extra: str) -> HeadProc:
    config = tmp / "echo-ray.yaml"
    config.write_text(CONFIG)
    head = HeadProc(
        tmp,
        "--deploy-config",
        str(config),
        "--worker-backend",
        "ray",
        "--ray-address",
        address,
        "--omni-heartbeat-timeout",
        "2",
        *extra,
    )
    head.wait_healthy(60)
    head.wait_up(1, 2, timeout=60)
    return head


def _nodes(head: HeadProc, stage_id: int) -> dict[int, str]:
    return {r["replica_id"]: r["node"] for r in head.up_replicas(stage_id)}


def test_replicas_spread_over_both_nodes_and_show_their_node(
    tmp_path: Path, cluster: tuple[Any, Any]
) -> None:
    c, worker = cluster
    head = _start(tmp_path, c.address)
    try:
        nodes = _nodes(head, 1)
        assert len(set(nodes.values())) == 2, nodes  # placement: spread
        assert worker.node_id in nodes.values()
        r = head.chat("hello ray")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == _expected("hello ray")
        metrics = head.client.get("/metrics").text
        for node in nodes.values():
            assert f'node="{node}"' in metrics
    finally:
        assert head.stop() == 0


@contextmanager
def _steady_load(head: HeadProc) -> Iterator[SteadyLoad]:
    """Chats back to back from 4 clients around the block; afterwards, with the load
    still flowing, every answer must have been right and none may hang."""
    load = SteadyLoad(head.url, _expected, workers=4).start()
    try:
        wait_for(lambda: load.ok >= 10, 30, what="load flowing")
        yield load
        ok = load.ok
        wait_for(lambda: load.ok >= ok + 10, 30, what="load flowing after")
    finally:
        load.stop()
    assert load.errors == [] and load.hung == 0, (load.errors[:5], load.hung)


def test_lost_node_under_load_loses_no_request_and_the_stage_refills(
    tmp_path: Path, cluster: tuple[Any, Any]
) -> None:
    c, worker = cluster
    head = _start(tmp_path, c.address)
    try:
        lost = [rid for rid, node in _nodes(head, 1).items() if node == worker.node_id]
        assert len(lost) == 1
        with _steady_load(head):
            wait_for(
                lambda: any(r["in_flight"] for r in head.up_replicas(1) if r["replica_id"] in lost),
                10,
                0.01,
                what="the worker node's replica busy",
            )
            killed_at = time.monotonic()
            c.remove_node(worker, allow_graceful=False)  # raylet and its workers: SIGKILL

            def lost_out_of_rotation() -> bool:
                return all(r["replica_id"] not in lost for r in head.up_replicas(1))

            wait_for(lost_out_of_rotation, 5, 0.02, what="the lost replica out of rotation")
            print(f"lost node's replica out of rotation after {time.monotonic() - killed_at:.2f}s")

            # The replacement can only go to the head node, which has room for both.
            def refilled() -> bool:
                nodes = _nodes(head, 1)
                return len(nodes) == 2 and worker.node_id not in nodes.values()

            wait_for(refilled, 30, what="stage 1 back to 2 replicas on the remaining node")
    finally:
        head.stop()


def test_killed_actor_is_replaced_without_losing_requests(
    tmp_path: Path, cluster: tuple[Any, Any]
) -> None:
    c, _ = cluster
    head = _start(tmp_path, c.address)
    try:
        victim = head.up_replicas(1)[0]
        actor_pid = parent_pid(victim["pid"])  # the replica is its actor's child
        assert actor_pid in replica_host_pids()
        with _steady_load(head):
            killed_at = time.monotonic()
            os.kill(actor_pid, signal.SIGKILL)

            def victim_gone() -> bool:
                return all(r["pid"] != victim["pid"] for r in head.up_replicas(1))

            wait_for(victim_gone, 5, 0.02, what="the killed replica out of rotation")
            print(f"killed actor out of rotation after {time.monotonic() - killed_at:.2f}s")
            wait_for(lambda: len(head.up_replicas(1)) == 2, 30, what="a replacement UP")
    finally:
        head.stop()


def test_requests_wait_for_the_replacement_of_a_stages_only_actor(
    tmp_path: Path, cluster: tuple[Any, Any]
) -> None:
    """The thinker runs one actor: killed, its stage has no live replica until Ray has
    placed and started the replacement, far past the 0.5 s stage wait; the requests
    meanwhile wait for it, and none fails."""
    c, _ = cluster
    head = _start(tmp_path, c.address, "--omni-stage-wait-timeout", "0.5")
    try:
        (victim,) = head.up_replicas(0)
        actor_pid = parent_pid(victim["pid"])
        with _steady_load(head):
            killed_at = time.monotonic()
            os.kill(actor_pid, signal.SIGKILL)
            wait_for(lambda: not head.up_replicas(0), 5, 0.02, what="the thinker down")
            # Once Ray has reported the actor dead (the closed connection may say so
            # first), the head knows a replacement is coming.
            wait_for(
                lambda: head.client.get("/health").json()["status"] == "restarting",
                5,
                0.02,
                what="/health restarting",
            )
            (replacement,) = head.wait_up(0, 1, 60, "the replacement UP")
            print(f"thinker actor replaced after {time.monotonic() - killed_at:.2f}s")
        assert replacement["epoch"] > victim["epoch"]
    finally:
        head.stop()


def test_headless_replica_joins_a_ray_head_and_shutdown_leaves_no_actor(
    tmp_path: Path, cluster: tuple[Any, Any]
) -> None:
    c, _ = cluster
    head = _start(tmp_path, c.address)
    extra = None
    try:
        assert len(replica_host_pids()) == 3  # thinker + two talkers
        extra = headless(tmp_path, head, 1, name="by-hand")
        wait_for(lambda: len(head.up_replicas(1)) == 3, 30, what="the headless replica UP")
        joined = head.up_replica_of(1, extra)
        assert joined["node"] is None  # not one of the head's actors
        for i in range(6):  # all three take traffic in turn
            r = head.chat(f"m{i}")
            assert r.json()["choices"][0]["message"]["content"] == _expected(f"m{i}")
    finally:
        if extra is not None:
            extra.stop()
        code = head.stop()
    assert code == 0
    # Every actor the head created is gone with it; the cluster itself stays up.
    wait_for(lambda: replica_host_pids() == [], 15, what="no ReplicaHost actor left")
    assert c.head_node.remaining_processes_alive()

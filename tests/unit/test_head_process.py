"""A head built in this process (echo pipeline, no replicas of its own) and a replica
runtime joining it in the same loop: registration, handshake, READY, heartbeats, and
the shutdown that reaches the replica."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from omnistage.config.load import load_config
from omnistage.head.options import HeadOptions
from omnistage.head.process import Head
from omnistage.net import free_ports
from omnistage.protocol.messages import ReplicaState
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.runtime import ReplicaRuntime


def _head(init_timeout_s: float = 10.0) -> Head:
    opts = HeadOptions(
        config=load_config("echo-1stage"),
        port=free_ports(1)[0],
        stage_id=0,
        dp_size_local=0,  # the replica joins from this test, not a subprocess
        heartbeat_interval_s=0.05,
        init_timeout_s=init_timeout_s,
        shutdown_grace_s=1.0,
    )
    return Head(opts)


async def _until(done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not done():
            await asyncio.sleep(0.01)


def test_a_replica_joins_an_in_process_head_and_leaves_when_it_stops() -> None:
    head = _head()
    assert head.service.stages_without_replicas() == [(0, "echo")]
    assert head.local.owned(0) == []  # --omni-dp-size-local 0: nothing launched

    async def scenario() -> tuple[int, int]:
        head_task = asyncio.create_task(head.run())
        replica = ReplicaRuntime(
            ReplicaOptions(
                stage_id=0, master_host="127.0.0.1", master_port=head.sockets.master_port
            )
        )
        replica_task = asyncio.create_task(replica.run())
        await _until(lambda: not head.service.stages_without_replicas())
        (entry,) = head.coordinator.snapshot()
        assert (entry.stage_id, entry.replica_id, entry.state) == (0, 0, ReplicaState.UP)
        assert not entry.local  # it registered without the head's local key
        assert head.slots.instance == head.instance
        head._stop.set()
        return await head_task, await asyncio.wait_for(replica_task, 10)

    head_code, replica_code = asyncio.run(scenario())
    assert head_code == 0
    assert replica_code == 0  # told to shut down by the head, not lost


def test_a_head_whose_stages_get_no_replica_gives_up_after_init_timeout() -> None:
    head = _head(init_timeout_s=0.2)
    assert asyncio.run(asyncio.wait_for(head.run(), 10)) == 1

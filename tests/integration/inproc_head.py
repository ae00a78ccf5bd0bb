"""A head run inside the test's own event loop, with real replica subprocesses.

For what has no HTTP route yet (streamed input: ``OutputStream.feed``): tests call the
head's ``PipelineService`` directly, as an in-process route would.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from omnistage.config.schema import DeployConfig
from omnistage.head.options import HeadOptions
from omnistage.head.process import Head
from omnistage.net import free_ports


async def until(done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not done():
            await asyncio.sleep(0.02)


@asynccontextmanager
async def running_head(
    config: DeployConfig, replicas: int = 1, start_timeout_s: float = 60.0, **opts: object
) -> AsyncIterator[Head]:
    """A head serving ``config`` with ``replicas`` local replicas per stage, all up."""
    stages = [s.model_copy(update={"replicas": replicas}) for s in config.stages]
    head = Head(
        HeadOptions(
            config=config.model_copy(update={"stages": stages}),
            port=free_ports(1)[0],
            shutdown_grace_s=2.0,
            **opts,  # type: ignore[arg-type]
        )
    )
    task = asyncio.create_task(head.run())
    try:
        await until(
            lambda: all(len(p.live()) >= replicas for p in head.pools.values()) or task.done(),
            start_timeout_s,
        )
        assert not task.done(), "the head stopped while starting"
        yield head
    finally:
        head._stop.set()
        await asyncio.wait_for(task, 30)


def kill_replica(head: Head, stage_id: int, replica_id: int) -> None:
    """SIGKILL one replica process (no goodbye: the head must notice by itself)."""
    (entry,) = [
        e
        for e in head.coordinator.snapshot()
        if e.stage_id == stage_id and e.replica_id == replica_id
    ]
    os.kill(entry.pid, signal.SIGKILL)

"""Putting the store to work in a head (or an API server process): open the store and
the media store from the flags, and build the job runner over the head's pipeline."""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

from omnistage import defaults
from omnistage.api.service import PipelineService
from omnistage.dataplane.stage_pool import StagePool
from omnistage.jobs.response import ResponseJobs
from omnistage.jobs.runner import JobHandler, JobRunner, RunnerSettings
from omnistage.jobs.state import Persistence
from omnistage.jobs.video import VideoJobs
from omnistage.protocol.errors import OmniError
from omnistage.store import open_media, open_store
from omnistage.store.records import JobKind

log = logging.getLogger(__name__)


class StoreUnavailable(OmniError):
    """The store or the media store could not be opened (a message naming the flag)."""


async def open_persistence(
    store_url: str | None, media_url: str | None, media_ttl_s: float
) -> Persistence:
    try:
        store = open_store(store_url)
        await store.start()
    except Exception as exc:
        raise StoreUnavailable(f"--store-url: cannot open the store: {exc}") from exc
    try:
        media = open_media(media_url)
    except Exception as exc:
        await store.close()
        raise StoreUnavailable(f"--media-url: cannot open the media store: {exc}") from exc
    return Persistence(store, media, media_ttl_s)


def head_name(port: int) -> str:
    """This head's name in job leases: stable across its restarts (host and HTTP port),
    so a restarted head frees what its previous run held at once."""
    return f"{socket.gethostname()}:{port}"


def build_runner(
    persist: Persistence,
    omni: PipelineService,
    pools: Mapping[int, StagePool],
    holder: str,
    lease_s: float = defaults.JOB_LEASE_S,
) -> JobRunner | None:
    """The runner of the job kinds this pipeline can run (None: none)."""
    handlers: dict[JobKind, JobHandler] = {}
    video = [s.stage_id for s in omni.config.stages if s.engine == "video"]
    if video:
        handlers[JobKind.VIDEO] = VideoJobs(omni, persist.media, video[0])
    text = omni.graph.finals_with({"text"})
    if text:
        handlers[JobKind.RESPONSE] = ResponseJobs(omni, persist.store, text[0])
    if not handlers:
        return None

    def room(stage_id: int) -> int:
        pool = pools.get(stage_id)
        if pool is None:
            return 0
        return sum(max(0, h.capacity - h.in_flight) for h in pool.live())

    settings = RunnerSettings(holder, lease_s=lease_s, media_ttl_s=persist.media_ttl_s)
    runner = JobRunner(persist.store, handlers, room, settings)
    persist.wake = runner.wake
    return runner

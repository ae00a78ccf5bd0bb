"""The head's job runner: the job kinds this pipeline can run, over the store."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from omnistage import defaults
from omnistage.api.background_responses import ResponseJobs
from omnistage.dataplane.stage_pool import StagePool
from omnistage.jobs.runner import JobHandler, JobRunner, RunnerSettings, StageRoom
from omnistage.jobs.state import Persistence
from omnistage.jobs.video import VideoJobs
from omnistage.protocol.enums import EngineName, Modality
from omnistage.service import PipelineService
from omnistage.store.records import JobKind


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
    video = [s.stage_id for s in omni.config.stages if s.engine == EngineName.VIDEO]
    if video:
        handlers[JobKind.VIDEO] = VideoJobs(omni, persist.media, video[0])
    text = omni.graph.finals_with({Modality.TEXT})
    if text:
        handlers[JobKind.RESPONSE] = ResponseJobs(omni, persist.store, text[0])
    if not handlers:
        return None

    def room(stage_id: int) -> StageRoom:
        pool = pools.get(stage_id)
        return StageRoom(*pool.slots()) if pool is not None else StageRoom(0, 0)

    settings = RunnerSettings(holder, lease_s=lease_s, media_ttl_s=persist.media_ttl_s)
    runner = JobRunner(persist.store, handlers, room, settings)
    persist.wake = runner.wake
    return runner

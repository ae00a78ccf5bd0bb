"""The job runner: claims jobs from the store and runs each through the pipeline.

Each head runs one. It claims a job only while the stage that runs it has room (the
live replicas' capacity), so jobs beyond what the fleet can take stay queued in the
database, where any head of the fleet may claim them. A running job's lease is renewed
(with its progress) while it runs; a head that dies stops renewing, and once the lease
expires another head, or this one restarted, runs the job again with the same seed. A
renewal that fails means the job was cancelled or deleted (or, after a long stall,
taken over): the run stops and finishes nothing.

A restarted head under the same name (``holder``) releases its previous run's leases
at start instead of waiting for them to expire: that run is dead, its jobs are not
running anywhere. Completed jobs expire after ``--media-ttl``: their media and rows
are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from omnistage import defaults
from omnistage.protocol.errors import StageOverloadedError, StageUnavailableError, as_api_error
from omnistage.protocol.front import PipelineRequest
from omnistage.service import OutputStream, PipelineService
from omnistage.store.base import Store
from omnistage.store.records import Job, JobKind, JobStatus

log = logging.getLogger(__name__)

# A renewal is also how a run learns that its job was cancelled or deleted: at least
# this often, whatever the lease.
RENEW_MAX_S = 2.0
SWEEP_EVERY_S = 60.0  # expired media are looked for this often


class JobFailed(Exception):
    """A job that cannot succeed (bad input found late, a failed generation)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def open_patiently(
    omni: PipelineService, request: PipelineRequest, retry_s: float = 1.0
) -> OutputStream:
    """``omni.open``, tried again while the stage is full or has no live replica: a job
    waits for room (its lease kept) where a client's request would get a 429 or 503."""
    while True:
        try:
            return await omni.open(request)
        except (StageOverloadedError, StageUnavailableError) as exc:
            log.info("job %s waits for room: %s", request.request_id, exc)
            await asyncio.sleep(retry_s)


class JobHandler(Protocol):
    """Runs one kind of job: returns its result (kept on the row), or raises."""

    kind: JobKind
    stage_id: int  # the stage whose capacity its jobs take

    async def run(self, job: Job, progress: Callable[[int], None]) -> dict[str, Any]: ...

    async def discard(self, job: Job) -> None:
        """Remove what the job left in the media store."""


@dataclass(frozen=True)
class StageRoom:
    """What a stage's live replicas can take: their slots, and how many are in use."""

    capacity: int
    in_flight: int

    def free(self, mine: int) -> int:
        """Free slots, counting ``mine`` (this runner's jobs on the stage) as taken even
        before they reach a replica: a job's request is dispatched a moment after its
        claim, and a runner woken in between must not claim those slots again."""
        return max(0, self.capacity - max(self.in_flight, mine))


@dataclass(frozen=True)
class RunnerSettings:
    holder: str  # this head's name in leases
    lease_s: float = defaults.JOB_LEASE_S
    max_attempts: int = defaults.JOB_MAX_ATTEMPTS
    media_ttl_s: float = defaults.MEDIA_TTL_S  # 0: never expire
    poll_s: float = 0.5  # how often the store is asked for new jobs when not woken
    progress_every_s: float = 0.5  # progress reaches the store at most this often


class JobRunner:
    def __init__(
        self,
        store: Store,
        handlers: Mapping[JobKind, JobHandler],
        room: Callable[[int], StageRoom],
        settings: RunnerSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``room(stage_id)``: that stage's live replicas' slots and their use now."""
        self.store = store
        self.handlers = dict(handlers)
        self.settings = settings
        self._room = room
        self._clock = clock
        self._wake = asyncio.Event()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._stage_of: dict[str, int] = {}  # running job -> the stage it takes a slot of
        # Jobs waiting in the store, by the stage that runs them, as of the last poll:
        # load the stage does not see yet, for the autoscaler (``backlog``).
        self._backlog: dict[int, int] = {}
        self.finished = 0  # jobs this runner completed or failed (for tests, stats)

    def wake(self) -> None:
        """A job was created: look for work now rather than at the next poll."""
        self._wake.set()

    def running(self) -> list[str]:
        return list(self._running)

    def backlog(self, stage_id: int) -> int:
        """Jobs queued in the store for ``stage_id`` at the last poll (for any head)."""
        return self._backlog.get(stage_id, 0)

    async def run(self) -> None:
        released = await self.store.release_leases(self.settings.holder)
        if released:
            log.info("released %d job(s) left running by this head's previous run", released)
        swept = 0.0
        try:
            while True:
                self._wake.clear()
                await self._fill()
                if self._clock() - swept >= SWEEP_EVERY_S:
                    swept = self._clock()
                    await self._sweep()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)
        finally:
            await self._stop()

    async def _fill(self) -> None:
        """Claim jobs of each kind while its stage has free slots (the stage may also
        serve other requests: a job takes a slot only when one is free now)."""
        for kind, handler in self.handlers.items():
            mine = sum(1 for sid in self._stage_of.values() if sid == handler.stage_id)
            for _ in range(self._room(handler.stage_id).free(mine)):
                job = await self.store.claim_job(
                    [kind],
                    self.settings.holder,
                    self._clock(),
                    self.settings.lease_s,
                    self.settings.max_attempts,
                )
                if job is None:
                    break
                self._start(handler, job)
            self._backlog[handler.stage_id] = await self.store.queued_jobs(kind)

    def _start(self, handler: JobHandler, job: Job) -> None:
        if job.attempts > 1:
            log.info("job %s: running again (attempt %d)", job.id, job.attempts)
        task = asyncio.create_task(self._run(handler, job), name=f"omni-job-{job.id}")
        self._running[job.id] = task
        self._stage_of[job.id] = handler.stage_id
        task.add_done_callback(lambda _: self._forget(job.id))

    def _forget(self, job_id: str) -> None:
        self._running.pop(job_id, None)
        self._stage_of.pop(job_id, None)
        self._wake.set()  # room for the next one

    async def _run(self, handler: JobHandler, job: Job) -> None:
        progress = _Progress()
        work = asyncio.create_task(handler.run(job, progress.set))
        keeper = asyncio.create_task(self._keep_lease(job, progress, work))
        try:
            result = await work
        except asyncio.CancelledError:
            if keeper.done() and not keeper.cancelled():
                return  # the lease is gone (cancelled, deleted, taken over): finish nothing
            raise  # the runner is stopping
        except Exception as exc:
            await self._finish(job, JobStatus.FAILED, error=_error_of(exc))
            return
        finally:
            keeper.cancel()
        await self._finish(job, JobStatus.COMPLETED, result=result)

    async def _keep_lease(self, job: Job, progress: _Progress, work: asyncio.Task[Any]) -> None:
        """Renew the lease every third of it (at most RENEW_MAX_S apart), and pass progress
        on as it moves; stop the work when the lease is gone (cancelled, deleted or taken
        over).

        Progress is sent the moment it first moves, then at most every
        ``progress_every_s``: a short job on a fast machine still shows a poller that it
        is under way before it is done (a fixed tick first sent only after the tick)."""
        s = self.settings
        every = min(s.lease_s / 3, RENEW_MAX_S)
        renewed = self._clock()
        sent = 0  # the claim just set the lease: nothing to send until progress moves
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(progress.moved.wait(), every - (self._clock() - renewed))
            now = self._clock()
            if progress.value == sent and now - renewed < every:
                continue
            progress.moved.clear()
            sent = progress.value
            ok = await self.store.renew_lease(job.id, s.holder, now, s.lease_s, sent)
            renewed = now
            if not ok:
                log.info("job %s: cancelled, deleted or taken over; stopping it", job.id)
                work.cancel()
                return
            await asyncio.sleep(s.progress_every_s)  # the store sees progress this often

    async def _finish(
        self,
        job: Job,
        status: JobStatus,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        now = self._clock()
        ttl = self.settings.media_ttl_s
        expires = now + ttl if ttl > 0 and status == JobStatus.COMPLETED else None
        ok = await self.store.finish_job(
            job.id,
            self.settings.holder,
            status,
            now,
            result=result,
            error=error,
            expires_at=expires,
        )
        if not ok:
            # Deleted meanwhile: what it made is nobody's. Taken over after a stall: the
            # head that runs it now writes the same keys, so nothing is removed.
            if await self.store.get_job(job.id, job.owner) is None:
                await self.handlers[job.kind].discard(job)
            return
        self.finished += 1
        if error is not None:
            log.warning("job %s failed: %s", job.id, error["message"])
        else:
            log.info("job %s completed", job.id)

    async def _sweep(self) -> None:
        """Remove completed jobs past their expiry: their media, then their rows."""
        for job in await self.store.expired_jobs(self._clock()):
            handler = self.handlers.get(job.kind)
            if handler is not None:
                await handler.discard(job)
            await self.store.delete_job(job.id, job.owner)
            log.info("job %s expired; its media were removed", job.id)

    async def _stop(self) -> None:
        """Stop running jobs and free their leases, so another head (or this one
        started again) runs them at once."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.store.release_leases(self.settings.holder)


class _Progress:
    def __init__(self) -> None:
        self.value = 0
        self.moved = asyncio.Event()

    def set(self, percent: int) -> None:
        value = max(self.value, min(99, int(percent)))  # 100 is for completed
        if value != self.value:
            self.value = value
            self.moved.set()


def _error_of(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, JobFailed):
        return {"code": exc.code, "message": exc.message}
    e = as_api_error(exc)
    code = "invalid_request" if 400 <= e.status < 500 else "generation_failed"
    return {"code": code, "message": e.message}

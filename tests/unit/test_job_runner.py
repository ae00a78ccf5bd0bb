"""The job runner over a real SQLite store: it claims only while the stage has room,
finishes what it runs, stops a job whose lease is gone, and a restarted runner under
the same name runs again what its previous run held."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from omnistage.jobs.runner import (
    JobFailed,
    JobRunner,
    RunnerSettings,
    StageRoom,
    open_patiently,
)
from omnistage.protocol.errors import StageOverloadedError, StageUnavailableError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import Prompt
from omnistage.store.base import Store
from omnistage.store.open import open_store
from omnistage.store.records import Job, JobKind, JobStatus


class Handler:
    """Jobs that wait for the test's go-ahead, then return or fail."""

    kind = JobKind.VIDEO
    stage_id = 0

    def __init__(self) -> None:
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.release = asyncio.Event()
        self.discarded: list[str] = []

    async def run(self, job: Job, progress: Callable[[int], None]) -> dict[str, Any]:
        self.started.append(job.id)
        progress(40)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(job.id)
            raise
        if job.request.get("fail"):
            raise JobFailed("generation_failed", "told to fail")
        return {"made": job.id, "attempt": job.attempts}

    async def discard(self, job: Job) -> None:
        self.discarded.append(job.id)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = open_store(f"sqlite:///{tmp_path / 'jobs.db'}")
    await s.start()
    yield s
    await s.close()


def _job(n: int, **request: Any) -> Job:
    return Job(id=f"job{n}", kind=JobKind.VIDEO, owner=None, request=request, created_at=100 + n)


def _runner(store: Store, handler: Handler, room: int = 2, holder: str = "head-a") -> JobRunner:
    """A runner over a stage of ``room`` slots that only its jobs use."""
    settings = RunnerSettings(holder, lease_s=5, poll_s=0.02, progress_every_s=0.02)
    runner = JobRunner(store, {JobKind.VIDEO: handler}, lambda sid: StageRoom(room, 0), settings)
    return runner


async def _until(cond: Callable[[], Any], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_it_runs_no_more_jobs_at_once_than_the_stage_has_room_for(store: Store) -> None:
    for n in range(5):
        await store.create_job(_job(n))
    handler = Handler()
    task = asyncio.create_task(_runner(store, handler, room=2).run())
    await _until(lambda: len(handler.started) == 2)
    await asyncio.sleep(0.1)
    assert handler.started == ["job0", "job1"]  # oldest first, and no more than 2
    handler.release.set()
    await _until(lambda: len(handler.started) == 5)
    for n in range(5):
        await _until_status(store, f"job{n}", JobStatus.COMPLETED)
    task.cancel()
    done = await store.get_job("job4", None)
    assert done is not None and done.result == {"made": "job4", "attempt": 1}


async def _until_status(store: Store, job_id: str, status: JobStatus) -> Job:
    for _ in range(500):
        job = await store.get_job(job_id, None)
        if job is not None and job.status == status:
            return job
        await asyncio.sleep(0.01)
    raise AssertionError(f"{job_id} never became {status}: {job}")


async def test_progress_reaches_the_store_while_the_job_runs(store: Store) -> None:
    await store.create_job(_job(0))
    handler = Handler()
    task = asyncio.create_task(_runner(store, handler).run())
    for _ in range(500):
        job = await store.get_job("job0", None)
        if job is not None and job.progress == 40:
            break
        await asyncio.sleep(0.01)
    assert job is not None and job.progress == 40 and job.status == JobStatus.IN_PROGRESS
    task.cancel()


async def test_the_first_progress_is_sent_at_once_not_after_the_progress_tick(
    store: Store,
) -> None:
    """A job shorter than the tick still shows a poller it is under way: the first move
    of progress goes to the store at once; later moves wait for the tick."""
    await store.create_job(_job(0))
    handler = Handler()
    settings = RunnerSettings("head-a", lease_s=300, poll_s=0.02, progress_every_s=60)
    runner = JobRunner(store, {JobKind.VIDEO: handler}, lambda sid: StageRoom(2, 0), settings)
    task = asyncio.create_task(runner.run())
    job = None
    for _ in range(300):
        job = await store.get_job("job0", None)
        if job is not None and job.progress == 40:
            break
        await asyncio.sleep(0.01)
    assert job is not None and (job.status, job.progress) == (JobStatus.IN_PROGRESS, 40)
    task.cancel()


async def test_a_failing_job_is_failed_with_its_reason(store: Store) -> None:
    await store.create_job(_job(0, fail=True))
    handler = Handler()
    handler.release.set()
    task = asyncio.create_task(_runner(store, handler).run())
    job = await _until_status(store, "job0", JobStatus.FAILED)
    task.cancel()
    assert job.error == {"code": "generation_failed", "message": "told to fail"}


async def test_a_cancelled_job_stops_running_and_finishes_nothing(store: Store) -> None:
    await store.create_job(_job(0))
    handler = Handler()
    task = asyncio.create_task(_runner(store, handler).run())
    await _until(lambda: handler.started)
    await store.cancel_job("job0", None, time.time())
    await _until(lambda: handler.cancelled == ["job0"])
    task.cancel()
    job = await store.get_job("job0", None)
    assert job is not None and job.status == JobStatus.CANCELLED and job.result is None


async def test_a_deleted_running_job_stops(store: Store) -> None:
    await store.create_job(_job(0))
    handler = Handler()
    task = asyncio.create_task(_runner(store, handler).run())
    await _until(lambda: handler.started)
    await store.delete_job("job0", None)
    await _until(lambda: handler.cancelled == ["job0"])
    task.cancel()


async def test_a_stopped_runner_frees_its_jobs_for_another_head(store: Store) -> None:
    await store.create_job(_job(0))
    first = Handler()
    task = asyncio.create_task(_runner(store, first, holder="head-a").run())
    await _until(lambda: first.started)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    second = Handler()
    second.release.set()
    other = asyncio.create_task(_runner(store, second, holder="head-b").run())
    job = await _until_status(store, "job0", JobStatus.COMPLETED)
    other.cancel()
    assert job.attempts == 2 and job.result == {"made": "job0", "attempt": 2}


async def test_a_restarted_head_runs_again_what_its_dead_run_held(store: Store) -> None:
    await store.create_job(_job(0))
    # A run of head-a that died holding the job (its lease far from expiry).
    held = await store.claim_job([JobKind.VIDEO], "head-a", time.time(), 600, 3)
    assert held is not None
    handler = Handler()
    handler.release.set()
    task = asyncio.create_task(_runner(store, handler, holder="head-a").run())
    job = await _until_status(store, "job0", JobStatus.COMPLETED)
    task.cancel()
    assert job.attempts == 2


async def test_no_room_means_jobs_wait_queued(store: Store) -> None:
    await store.create_job(_job(0))
    handler = Handler()
    runner = _runner(store, handler, room=0)
    task = asyncio.create_task(runner.run())
    await asyncio.sleep(0.2)
    task.cancel()
    job = await store.get_job("job0", None)
    assert handler.started == [] and job is not None and job.status == JobStatus.QUEUED
    assert runner.backlog(0) == 1  # what the autoscaler sees waiting for the stage


async def test_a_finished_jobs_media_expire_after_the_ttl(store: Store) -> None:
    now = [1000.0]
    await store.create_job(_job(0))
    handler = Handler()
    handler.release.set()
    settings = RunnerSettings(
        "head-a", lease_s=5, poll_s=0.02, progress_every_s=0.02, media_ttl_s=3600
    )
    runner = JobRunner(
        store,
        {JobKind.VIDEO: handler},
        lambda sid: StageRoom(1, 0),
        settings,
        lambda: now[0],
    )
    task = asyncio.create_task(runner.run())
    job = await _until_status(store, "job0", JobStatus.COMPLETED)
    assert job.expires_at == 1000.0 + 3600
    now[0] += 3599  # a sweep runs (a minute has passed), but the media are not due yet
    await asyncio.sleep(0.1)
    assert await store.get_job("job0", None) is not None and handler.discarded == []
    now[0] += 120
    await _until(lambda: handler.discarded == ["job0"])
    await _until_gone(store, "job0")
    task.cancel()


async def _until_gone(store: Store, job_id: str) -> None:
    for _ in range(500):
        if await store.get_job(job_id, None) is None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{job_id} was not removed")


class _FullStage:
    """A service whose stage is full ``busy`` times, then takes the request."""

    def __init__(self, busy: int) -> None:
        self.busy = busy
        self.tries = 0

    async def open(self, request: PipelineRequest) -> str:
        self.tries += 1
        if self.tries <= self.busy:
            if self.tries % 2:
                raise StageOverloadedError(0, "video", "queue full")
            raise StageUnavailableError(0, "video", 3.0, "is at capacity")
        return "stream"


async def test_a_job_waits_for_room_where_a_client_would_be_refused() -> None:
    omni = _FullStage(busy=3)
    request = PipelineRequest("job0-1", Prompt(text="x"), [0])
    got = await open_patiently(omni, request, retry_s=0.01)  # type: ignore[arg-type]
    assert (got, omni.tries) == ("stream", 4)

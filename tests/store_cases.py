"""The ``Store`` behaviours, written once and run on each backend.

``StoreCases`` is not collected itself (no Test prefix): tests/unit/test_store_sql.py runs
it on SQLite files, tests/integration/test_store_postgres.py on a real PostgreSQL server,
each subclass giving the ``store_url`` fixture (a fresh, empty database per test).
Times are injected (``now``), so leases expire without sleeping; only the tests with
several processes use the clock.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import time
import traceback
from collections.abc import AsyncIterator
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from omnistage.store.engine import schema_revision
from omnistage.store.records import Job, JobKind, JobStatus, RealtimeRecord, StoredResponse
from omnistage.store.sql import SqlStore
from omnistage.store.tables import VERSION_TABLE, metadata

VIDEO, RESPONSE = JobKind.VIDEO, JobKind.RESPONSE
LEASE = 10.0
HEAD = "0002"  # the newest schema revision


def job(job_id: str, created_at: float, owner: str | None = "alice", **fields: Any) -> Job:
    fields.setdefault("kind", VIDEO)
    return Job(id=job_id, owner=owner, created_at=created_at, request={"n": job_id}, **fields)


def response(response_id: str, owner: str | None = "alice", **fields: Any) -> StoredResponse:
    fields.setdefault("status", "completed")
    return StoredResponse(
        id=response_id, owner=owner, created_at=1.0, conversation=response_id, **fields
    )


def session(session_id: str, **fields: Any) -> RealtimeRecord:
    fields = {"created_at": 1.0, "expires_at": 100.0, **fields}
    return RealtimeRecord(id=session_id, owner="alice", token_hash="hash-1", **fields)


async def claim(store: SqlStore, holder: str, now: float, max_attempts: int = 3) -> Job | None:
    return await store.claim_job([VIDEO], holder, now, LEASE, max_attempts)


def _run_in_process(target: Any, args_list: list[tuple[Any, ...]]) -> list[Any]:
    """Run ``target(*args, barrier, results)`` in one spawned process per args; their
    results (a worker's exception fails the test with its traceback)."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(args_list)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, results)) for args in args_list]
    for proc in procs:
        proc.start()
    out: list[tuple[bool, Any]] = []
    deadline = time.monotonic() + 120
    try:
        while len(out) < len(procs):
            try:
                out.append(results.get(timeout=0.5))
            except queue.Empty:
                # A worker that died before reporting (an import failed, say) would
                # otherwise keep this waiting out the deadline.
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a worker process exited with {dead[0]}"
                assert time.monotonic() < deadline, "the worker processes did not finish"
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    errors = [text for ok, text in out if not ok]
    assert not errors, errors[0]
    return [value for _, value in out]


def _worker(coro_fn: Any, args: tuple[Any, ...], barrier: Any, results: Any) -> None:
    try:
        results.put((True, asyncio.run(coro_fn(*args, barrier))))
    except BaseException:
        results.put((False, traceback.format_exc()))


async def _claim_all(url: str, holder: str, barrier: Any) -> tuple[str, list[str]]:
    store = SqlStore(url)
    await store.start()
    barrier.wait(60)
    claimed = []
    while (found := await store.claim_job([VIDEO], holder, time.time(), 3600, 3)) is not None:
        claimed.append(found.id)
        await asyncio.sleep(0.002)  # a little work, so that the workers interleave
        assert await store.finish_job(found.id, holder, JobStatus.COMPLETED, time.time())
    await store.close()
    return holder, claimed


def claim_worker(url: str, holder: str, barrier: Any, results: Any) -> None:
    _worker(_claim_all, (url, holder), barrier, results)


async def _start(url: str, barrier: Any) -> str | None:
    store = SqlStore(url)
    barrier.wait(60)
    await store.start()
    try:
        return schema_revision(store.engine)
    finally:
        await store.close()


def start_worker(url: str, barrier: Any, results: Any) -> None:
    _worker(_start, (url,), barrier, results)


class StoreCases:
    @pytest.fixture
    async def store(self, store_url: str) -> AsyncIterator[SqlStore]:
        store = SqlStore(store_url)
        await store.start()
        try:
            yield store
        finally:
            await store.close()

    # -- jobs: rows, owners, pages ---------------------------------------------------

    async def test_a_job_is_found_by_its_owner_only(self, store: SqlStore) -> None:
        created = job("j1", 1.0, result={"k": [1, 2]})
        await store.create_job(created)
        await store.create_job(job("j2", 2.0, owner=None))
        assert await store.get_job("j1", "alice") == created
        assert await store.get_job("j1", "bob") is None
        assert await store.get_job("j1", None) is None
        assert (await store.get_job("j2", None)).owner is None
        assert await store.get_job("j2", "alice") is None
        assert await store.get_job("nope", "alice") is None

    async def test_delete_returns_the_row_to_its_owner_only(self, store: SqlStore) -> None:
        await store.create_job(job("j1", 1.0))
        assert await store.delete_job("j1", "bob") is None
        assert (await store.delete_job("j1", "alice")).id == "j1"
        assert await store.get_job("j1", "alice") is None
        assert await store.delete_job("j1", "alice") is None

    async def test_pages_walk_every_job_once_in_both_orders(self, store: SqlStore) -> None:
        # Two jobs share a created_at: the id orders them, the same way on every page.
        times = {"a": 1.0, "b": 2.0, "d": 3.0, "c": 3.0, "e": 4.0, "f": 5.0, "g": 6.0}
        for job_id, at in times.items():
            await store.create_job(job(job_id, at))
        await store.create_job(job("other-kind", 2.5, kind=RESPONSE))
        await store.create_job(job("other-owner", 2.5, owner="bob"))
        oldest = ["a", "b", "c", "d", "e", "f", "g"]
        for newest_first, expected in ((False, oldest), (True, oldest[::-1])):
            seen, after, pages = [], None, 0
            while True:
                page = await store.list_jobs(
                    VIDEO, "alice", after=after, limit=3, newest_first=newest_first
                )
                seen += [j.id for j in page.items]
                pages += 1
                if not page.has_more:
                    break
                after = page.items[-1].id
            assert seen == expected
            assert pages == 3
        whole = await store.list_jobs(VIDEO, "alice", limit=7)
        assert len(whole.items) == 7 and not whole.has_more
        assert (await store.list_jobs(VIDEO, "bob")).items[0].id == "other-owner"
        unknown = await store.list_jobs(VIDEO, "alice", after="other-owner")
        assert unknown.items == [] and not unknown.has_more

    # -- jobs: claims and leases ---------------------------------------------------------

    async def test_claims_take_the_oldest_job_of_the_kinds_asked(self, store: SqlStore) -> None:
        for job_id, at in (("v3", 3.0), ("v1", 1.0), ("v2", 2.0)):
            await store.create_job(job(job_id, at))
        await store.create_job(job("r0", 0.0, kind=RESPONSE))
        assert await store.claim_job([], "h", 10.0, LEASE, 3) is None
        got = [(await claim(store, "h", 10.0)).id for _ in range(3)]
        assert got == ["v1", "v2", "v3"]
        assert await claim(store, "h", 10.0) is None
        taken = await store.claim_job([RESPONSE, VIDEO], "h", 10.0, LEASE, 3)
        assert taken.id == "r0"
        assert taken.status is JobStatus.IN_PROGRESS
        assert (taken.lease_owner, taken.lease_until, taken.attempts) == ("h", 20.0, 1)
        assert taken.started_at == 10.0

    async def test_a_leased_job_is_not_claimed_by_another(self, store: SqlStore) -> None:
        await store.create_job(job("j1", 1.0))
        assert (await claim(store, "a", 100.0)).id == "j1"
        assert await claim(store, "b", 100.0) is None
        assert await claim(store, "b", 100.0 + LEASE - 0.001) is None

    async def test_renewal_extends_the_lease_and_records_progress(self, store: SqlStore) -> None:
        await store.create_job(job("j1", 1.0))
        await claim(store, "a", 100.0)
        assert await store.renew_lease("j1", "a", 108.0, LEASE, progress=40)
        stored = await store.get_job("j1", "alice")
        assert (stored.lease_until, stored.progress) == (118.0, 40)
        assert await claim(store, "b", 115.0) is None  # would have expired at 110
        assert await store.renew_lease("j1", "a", 116.0, LEASE)  # progress kept
        assert (await store.get_job("j1", "alice")).progress == 40
        assert not await store.renew_lease("j1", "b", 116.0, LEASE)

    async def test_an_expired_lease_is_taken_over_as_a_rerun(self, store: SqlStore) -> None:
        await store.create_job(job("j1", 1.0))
        await claim(store, "a", 100.0)
        taken = await claim(store, "b", 110.0)
        assert (taken.id, taken.lease_owner, taken.attempts) == ("j1", "b", 2)
        assert taken.started_at == 100.0  # when the job first started
        assert not await store.renew_lease("j1", "a", 111.0, LEASE)
        assert not await store.finish_job("j1", "a", JobStatus.COMPLETED, 111.0)
        assert await store.finish_job(
            "j1", "b", JobStatus.COMPLETED, 112.0, result={"size": 3}, expires_at=500.0
        )
        done = await store.get_job("j1", "alice")
        assert done.status is JobStatus.COMPLETED
        assert (done.result, done.progress, done.completed_at) == ({"size": 3}, 100, 112.0)
        assert (done.expires_at, done.lease_until, done.error) == (500.0, None, None)
        assert not await store.finish_job("j1", "b", JobStatus.FAILED, 113.0)

    async def test_an_expired_lease_is_renewable_until_taken_over(self, store: SqlStore) -> None:
        await store.create_job(job("j1", 1.0))
        await claim(store, "a", 100.0)
        assert await store.renew_lease("j1", "a", 130.0, LEASE)
        assert await claim(store, "b", 135.0) is None

    async def test_a_job_interrupted_max_attempts_times_fails(self, store: SqlStore) -> None:
        await store.create_job(job("j1", 1.0))
        await store.create_job(job("j2", 2.0))
        assert (await claim(store, "a", 100.0, max_attempts=2)).id == "j1"
        assert (await claim(store, "b", 110.0, max_attempts=2)).id == "j1"  # attempt 2
        # j1's second lease expired too: it fails, and the claim moves on to j2.
        assert (await claim(store, "c", 120.0, max_attempts=2)).id == "j2"
        failed = await store.get_job("j1", "alice")
        assert failed.status is JobStatus.FAILED
        assert failed.error["code"] == "interrupted"
        assert "interrupted 2 times" in failed.error["message"]
        assert (failed.attempts, failed.completed_at, failed.lease_until) == (2, 120.0, None)
        assert not await store.renew_lease("j1", "b", 121.0, LEASE)
        assert not await store.finish_job("j1", "b", JobStatus.COMPLETED, 121.0)

    async def test_finishing_takes_completed_or_failed(self, store: SqlStore) -> None:
        await store.create_job(job("j1", 1.0))
        await claim(store, "a", 100.0)
        with pytest.raises(ValueError):
            await store.finish_job("j1", "a", JobStatus.CANCELLED, 101.0)
        error = {"code": "engine_error", "message": "boom"}
        assert await store.finish_job("j1", "a", JobStatus.FAILED, 101.0, error=error)
        failed = await store.get_job("j1", "alice")
        assert (failed.status, failed.error, failed.progress) == (JobStatus.FAILED, error, 0)

    async def test_cancelling_stops_the_holder_and_keeps_finished_jobs(
        self, store: SqlStore
    ) -> None:
        for job_id, at in (("queued", 1.0), ("running", 2.0), ("done", 3.0)):
            await store.create_job(job(job_id, at))
        assert (await claim(store, "a", 100.0)).id == "queued"
        await store.cancel_job("queued", "alice", 100.5)  # running now: cancelled anyway
        assert (await claim(store, "a", 101.0)).id == "running"
        assert (await claim(store, "a", 101.0)).id == "done"
        assert await store.finish_job("done", "a", JobStatus.COMPLETED, 102.0)

        assert await store.cancel_job("running", "bob", 103.0) is None
        cancelled = await store.cancel_job("running", "alice", 103.0)
        assert (cancelled.status, cancelled.completed_at) == (JobStatus.CANCELLED, 103.0)
        assert not await store.renew_lease("running", "a", 104.0, LEASE)
        assert not await store.finish_job("running", "a", JobStatus.COMPLETED, 104.0)
        assert await claim(store, "b", 1000.0) is None  # nothing cancelled is run again
        unchanged = await store.cancel_job("done", "alice", 105.0)
        assert (unchanged.status, unchanged.completed_at) == (JobStatus.COMPLETED, 102.0)
        assert await store.cancel_job("nope", "alice", 105.0) is None

    async def test_a_queued_job_cancelled_is_never_claimed(self, store: SqlStore) -> None:
        await store.create_job(job("j1", 1.0))
        assert (await store.cancel_job("j1", "alice", 5.0)).status is JobStatus.CANCELLED
        assert await claim(store, "a", 10.0) is None

    async def test_a_deleted_job_stops_its_holder(self, store: SqlStore) -> None:
        await store.create_job(job("j1", 1.0))
        await claim(store, "a", 100.0)
        await store.delete_job("j1", "alice")
        assert not await store.renew_lease("j1", "a", 101.0, LEASE)
        assert not await store.finish_job("j1", "a", JobStatus.COMPLETED, 101.0)

    async def test_released_leases_are_claimable_at_once(self, store: SqlStore) -> None:
        for job_id, at in (("a1", 1.0), ("a2", 2.0), ("b1", 3.0)):
            await store.create_job(job(job_id, at))
        await claim(store, "head-a", 100.0)
        await claim(store, "head-a", 100.0)
        await claim(store, "head-b", 100.0)
        assert await store.release_leases("head-a") == 2
        assert await store.release_leases("head-a") == 0
        assert not await store.renew_lease("a1", "head-a", 101.0, LEASE)
        again = [await claim(store, "head-c", 101.0) for _ in range(3)]
        assert [(j.id, j.attempts) for j in again if j] == [("a1", 2), ("a2", 2)]
        assert await store.renew_lease("b1", "head-b", 101.0, LEASE)

    async def test_expired_jobs_are_finished_ones_past_expires_at(self, store: SqlStore) -> None:
        for job_id, expires in (("old", 50.0), ("older", 40.0), ("new", 150.0)):
            await store.create_job(job(job_id, 1.0))
            await claim(store, "h", 10.0)
            assert await store.finish_job(
                job_id, "h", JobStatus.COMPLETED, 20.0, expires_at=expires
            )
        await store.create_job(job("running", 2.0))
        await claim(store, "h", 10.0)
        assert [j.id for j in await store.expired_jobs(100.0)] == ["older", "old"]
        assert [j.id for j in await store.expired_jobs(100.0, limit=1)] == ["older"]
        assert await store.expired_jobs(30.0) == []

    # -- stored responses ----------------------------------------------------------------

    async def test_responses_are_put_replaced_and_deleted(self, store: SqlStore) -> None:
        first = response(
            "r1",
            status="in_progress",
            previous_response_id="r0",
            input_items=[{"type": "message", "role": "user", "content": "hi"}],
        )
        await store.put_response(first)
        assert await store.get_response("r1", "alice") == first
        assert await store.get_response("r1", "bob") is None
        final = response("r1", body={"output": [{"text": "héllo"}], "usage": {"n": 2}})
        await store.put_response(final)
        assert await store.get_response("r1", "alice") == final
        assert not await store.delete_response("r1", "bob")
        assert await store.delete_response("r1", "alice")
        assert await store.get_response("r1", "alice") is None
        assert not await store.delete_response("r1", "alice")
        keyless = response("r2", owner=None)
        await store.put_response(keyless)
        assert await store.get_response("r2", None) == keyless
        assert await store.get_response("r2", "alice") is None

    # -- saved Realtime sessions ------------------------------------------------------

    async def test_a_session_resumes_with_its_owner_and_token_only(self, store: SqlStore) -> None:
        items = [{"item": {"id": "item_1", "type": "message"}}]
        await store.create_realtime_session(session("s1", expires_at=100.0))
        assert await store.save_realtime_session("s1", 0, {"instructions": "hi"}, items, 200.0)
        assert await store.resume_realtime_session("s1", "bob", "hash-1", 150.0) is None
        assert await store.resume_realtime_session("s1", "alice", "hash-2", 150.0) is None
        assert await store.resume_realtime_session("s2", "alice", "hash-1", 150.0) is None
        found = await store.resume_realtime_session("s1", "alice", "hash-1", 150.0)
        assert found is not None and found.generation == 1
        assert (found.config, found.items, found.expires_at) == (
            {"instructions": "hi"},
            items,
            200.0,
        )
        # Past its expiry (moved on by the save) it is gone.
        assert await store.resume_realtime_session("s1", "alice", "hash-1", 201.0) is None

    async def test_a_resume_fences_the_connection_before_it(self, store: SqlStore) -> None:
        await store.create_realtime_session(session("s1"))
        assert await store.resume_realtime_session("s1", "alice", "hash-1", 1.0) is not None
        # The first connection (generation 0) saves no more; the resumed one (1) does.
        assert not await store.save_realtime_session("s1", 0, {}, [], 50.0)
        assert await store.save_realtime_session("s1", 1, {"n": 1}, [], 50.0)
        assert not await store.save_realtime_session("nope", 0, {}, [], 50.0)

    async def test_expired_sessions_go_as_new_ones_come(self, store: SqlStore) -> None:
        await store.create_realtime_session(session("old", expires_at=10.0))
        await store.create_realtime_session(session("new", created_at=20.0, expires_at=30.0))
        assert not await store.save_realtime_session("old", 0, {}, [], 50.0)
        assert await store.save_realtime_session("new", 0, {}, [], 50.0)

    # -- schema ----------------------------------------------------------------------------

    async def test_starting_again_keeps_the_schema_and_the_rows(self, store_url: str) -> None:
        store = SqlStore(store_url)
        await store.start()
        await store.start()
        await store.create_job(job("j1", 1.0))
        assert schema_revision(store.engine) == HEAD
        await store.close()
        await store.close()
        again = SqlStore(store_url)  # a database at the head, opened by a new process's store
        await again.start()
        try:
            assert (await again.get_job("j1", "alice")).id == "j1"
            assert schema_revision(again.engine) == HEAD
        finally:
            await again.close()

    async def test_the_migrated_schema_is_what_the_queries_expect(self, store: SqlStore) -> None:
        with store.engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            assert compare_metadata(context, metadata) == []

    async def test_a_store_not_started_says_so(self, store_url: str) -> None:
        with pytest.raises(RuntimeError, match="not started"):
            await SqlStore(store_url).get_job("j1", None)

    # -- several processes -------------------------------------------------------------

    def test_processes_starting_together_all_get_the_schema(self, store_url: str) -> None:
        revisions = _run_in_process(start_worker, [(store_url,)] * 4)
        assert revisions == [HEAD] * 4

    async def test_processes_claiming_together_take_each_job_once(
        self, store: SqlStore, store_url: str
    ) -> None:
        ids = [f"job{i:02d}" for i in range(50)]
        for i, job_id in enumerate(ids):
            await store.create_job(job(job_id, float(i)))
        holders = [f"worker{i}" for i in range(4)]
        claims = dict(
            await asyncio.to_thread(
                _run_in_process, claim_worker, [(store_url, h) for h in holders]
            )
        )
        everything = [job_id for got in claims.values() for job_id in got]
        assert sorted(everything) == ids  # each exactly once
        assert sum(1 for got in claims.values() if got) >= 2, claims  # they did contend
        for holder, got in claims.items():
            for job_id in got:
                done = await store.get_job(job_id, "alice")
                assert (done.status, done.lease_owner, done.attempts) == (
                    JobStatus.COMPLETED,
                    holder,
                    1,
                )

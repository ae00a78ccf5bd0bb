"""The jobs' queries of ``SqlStore``: creation, pages, leases and expiry (see
``base.Store`` for what each promises)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import msgspec
import sqlalchemy as sa

from omnistage.store import engine as db
from omnistage.store.database import SqlDatabase, owned
from omnistage.store.records import Job, JobKind, JobStatus, Page
from omnistage.store.tables import TIME, jobs

_RUNNING = JobStatus.IN_PROGRESS.value
_UNFINISHED = [JobStatus.QUEUED.value, JobStatus.IN_PROGRESS.value]


def _job(row: sa.Row[Any]) -> Job:
    return msgspec.convert(row, Job, from_attributes=True)


def interrupted_error(attempts: int) -> dict[str, Any]:
    return {
        "code": "interrupted",
        "message": f"the job was interrupted {attempts} times (the server running it "
        "stopped) and is not tried again",
    }


@functools.cache
def _claim_queries(lock: bool) -> tuple[sa.Select[Any], sa.Update]:
    """The expired jobs to fail (claimed ``max_attempts`` times), and the claim of the
    oldest runnable job as one UPDATE ... RETURNING (run after those are failed).

    The oldest runnable job is the older of two index seeks, the oldest queued job and
    the oldest expired one, so a claim does not read the finished jobs piling up until
    their expiry. ``lock``: FOR UPDATE SKIP LOCKED (PostgreSQL). Built once, with bound
    parameters (building them took as long as running them): kinds, now, max_attempts,
    holder, lease_end (no parameter is named after a column: an UPDATE would take it
    for a value to set).
    """
    ours = jobs.c.kind.in_(sa.bindparam("kinds", expanding=True))
    now = sa.bindparam("now", type_=TIME)
    expired = (jobs.c.status == _RUNNING, jobs.c.lease_until <= now)
    oldest = (jobs.c.created_at, jobs.c.id)
    exhausted = sa.select(jobs.c.id, jobs.c.attempts).where(
        ours, *expired, jobs.c.attempts >= sa.bindparam("max_attempts")
    )
    heads = [
        sa.select(jobs.c.id, *oldest).where(ours, *where).order_by(*oldest).limit(1)
        for where in ((jobs.c.status == JobStatus.QUEUED.value,), expired)
    ]
    if lock:
        exhausted = exhausted.with_for_update(skip_locked=True)
        heads = [head.with_for_update(skip_locked=True) for head in heads]
    both = sa.union_all(*(sa.select(head.subquery()) for head in heads)).subquery()
    pick = sa.select(both.c.id).order_by(both.c.created_at, both.c.id).limit(1)
    claim = (
        sa.update(jobs)
        .where(jobs.c.id == pick.scalar_subquery())
        .values(
            status=_RUNNING,
            lease_owner=sa.bindparam("holder"),
            lease_until=sa.bindparam("lease_end", type_=TIME),
            attempts=jobs.c.attempts + 1,
            started_at=sa.func.coalesce(jobs.c.started_at, now),
        )
        .returning(*jobs.c)
    )
    return exhausted, claim


class SqlJobs(SqlDatabase):
    """The job methods of the ``Store``."""

    async def create_job(self, job: Job) -> None:
        await self._call(self._create_job, msgspec.to_builtins(job))

    def _create_job(self, row: dict[str, Any]) -> None:
        with self._write() as conn:
            conn.execute(jobs.insert(), row)

    async def get_job(self, job_id: str, owner: str | None) -> Job | None:
        return await self._call(self._get_job, job_id, owner)

    def _get_job(self, job_id: str, owner: str | None) -> Job | None:
        with self._read() as conn:
            query = sa.select(jobs).where(jobs.c.id == job_id, owned(jobs, owner))
            row = conn.execute(query).first()
        return None if row is None else _job(row)

    async def list_jobs(
        self,
        kind: JobKind,
        owner: str | None,
        *,
        after: str | None = None,
        limit: int = 20,
        newest_first: bool = True,
    ) -> Page:
        """Jobs of ``kind`` after the job ``after`` (exclusive) in the order asked; an
        ``after`` that names no job of this kind and owner gives an empty page."""
        return await self._call(self._list_jobs, kind, owner, after, max(limit, 0), newest_first)

    def _list_jobs(
        self, kind: JobKind, owner: str | None, after: str | None, limit: int, newest: bool
    ) -> Page:
        mine = (jobs.c.kind == kind.value, owned(jobs, owner))
        query = sa.select(jobs).where(*mine)
        with self._read() as conn:
            if after is not None:
                cursor = conn.execute(
                    sa.select(jobs.c.created_at, jobs.c.id).where(jobs.c.id == after, *mine)
                ).first()
                if cursor is None:
                    return Page([], False)
                at, key = cursor
                if newest:
                    beyond = sa.or_(
                        jobs.c.created_at < at, sa.and_(jobs.c.created_at == at, jobs.c.id < key)
                    )
                else:
                    beyond = sa.or_(
                        jobs.c.created_at > at, sa.and_(jobs.c.created_at == at, jobs.c.id > key)
                    )
                query = query.where(beyond)
            order = (jobs.c.created_at, jobs.c.id)
            if newest:
                order = (jobs.c.created_at.desc(), jobs.c.id.desc())
            rows = conn.execute(query.order_by(*order).limit(limit + 1)).all()
        return Page([_job(row) for row in rows[:limit]], len(rows) > limit)

    async def delete_job(self, job_id: str, owner: str | None) -> Job | None:
        return await self._call(self._delete_job, job_id, owner)

    def _delete_job(self, job_id: str, owner: str | None) -> Job | None:
        query = sa.delete(jobs).where(jobs.c.id == job_id, owned(jobs, owner))
        with self._write() as conn:
            row = conn.execute(query.returning(*jobs.c)).first()
        return None if row is None else _job(row)

    async def cancel_job(self, job_id: str, owner: str | None, now: float) -> Job | None:
        return await self._call(self._cancel_job, job_id, owner, now)

    def _cancel_job(self, job_id: str, owner: str | None, now: float) -> Job | None:
        this = (jobs.c.id == job_id, owned(jobs, owner))
        cancel = (
            sa.update(jobs)
            .where(*this, jobs.c.status.in_([JobStatus.QUEUED.value, _RUNNING]))
            .values(status=JobStatus.CANCELLED.value, completed_at=now, lease_until=None)
        )
        with self._write() as conn:
            row = conn.execute(cancel.returning(*jobs.c)).first()
            if row is None:  # finished already, or not there
                row = conn.execute(sa.select(jobs).where(*this)).first()
        return None if row is None else _job(row)

    async def claim_job(
        self,
        kinds: Sequence[JobKind],
        holder: str,
        now: float,
        lease_s: float,
        max_attempts: int,
    ) -> Job | None:
        if not kinds:
            return None
        names = [kind.value for kind in kinds]
        return await self._call(self._claim_job, names, holder, now, lease_s, max_attempts)

    def _claim_job(
        self, kinds: list[str], holder: str, now: float, lease_s: float, max_attempts: int
    ) -> Job | None:
        # On PostgreSQL, rows another head is claiming right now are skipped, not waited
        # for; on SQLite the transaction holds the database's write lock instead.
        exhausted, claim = _claim_queries(not db.is_sqlite(self.engine))
        params = {"kinds": kinds, "now": now, "max_attempts": max_attempts}
        with self._write() as conn:
            for job_id, attempts in conn.execute(exhausted, params).all():
                self._fail_interrupted(conn, job_id, attempts, now)
            params |= {"holder": holder, "lease_end": now + lease_s}
            row = conn.execute(claim, params).first()
        return None if row is None else _job(row)

    @staticmethod
    def _fail_interrupted(conn: sa.Connection, job_id: str, attempts: int, now: float) -> None:
        conn.execute(
            sa.update(jobs)
            .where(jobs.c.id == job_id)
            .values(
                status=JobStatus.FAILED.value,
                error=interrupted_error(attempts),
                completed_at=now,
                lease_until=None,
            )
        )

    async def renew_lease(
        self, job_id: str, holder: str, now: float, lease_s: float, progress: int | None = None
    ) -> bool:
        values: dict[str, Any] = {"lease_until": now + lease_s}
        if progress is not None:
            values["progress"] = progress
        return await self._call(self._update_held, job_id, holder, values)

    def _update_held(self, job_id: str, holder: str, values: dict[str, Any]) -> bool:
        """Update the job if ``holder`` holds its lease; whether it did."""
        query = (
            sa.update(jobs)
            .where(jobs.c.id == job_id, jobs.c.lease_owner == holder, jobs.c.status == _RUNNING)
            .values(**values)
        )
        with self._write() as conn:
            return conn.execute(query).rowcount == 1

    async def finish_job(
        self,
        job_id: str,
        holder: str,
        status: JobStatus,
        now: float,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        expires_at: float | None = None,
    ) -> bool:
        if status not in (JobStatus.COMPLETED, JobStatus.FAILED):
            raise ValueError(f"a job finishes completed or failed, not {status.value}")
        values: dict[str, Any] = {
            "status": status.value,
            "completed_at": now,
            "lease_until": None,
            "result": result,
            "error": error,
            "expires_at": expires_at,
        }
        if status is JobStatus.COMPLETED:
            values["progress"] = 100
        return await self._call(self._update_held, job_id, holder, values)

    async def release_leases(self, holder: str) -> int:
        return await self._call(self._release_leases, holder)

    def _release_leases(self, holder: str) -> int:
        # Expired (lease_until 0) rather than queued: the next claim counts the lost run
        # against max_attempts like any other interruption.
        query = (
            sa.update(jobs)
            .where(jobs.c.lease_owner == holder, jobs.c.status == _RUNNING)
            .values(lease_owner=None, lease_until=0.0)
        )
        with self._write() as conn:
            return conn.execute(query).rowcount

    async def expired_jobs(self, now: float, limit: int = 100) -> list[Job]:
        return await self._call(self._expired_jobs, now, limit)

    def _expired_jobs(self, now: float, limit: int) -> list[Job]:
        query = (
            sa.select(jobs)
            # NOT IN, which no index serves: SQLite then seeks ix_jobs_expires, rather
            # than reading every finished job through the status index.
            .where(jobs.c.expires_at <= now, jobs.c.status.not_in(_UNFINISHED))
            .order_by(jobs.c.expires_at)
            .limit(limit)
        )
        with self._read() as conn:
            return [_job(row) for row in conn.execute(query).all()]

    async def queued_jobs(self, kind: JobKind) -> int:
        return await self._call(self._queued_jobs, kind)

    def _queued_jobs(self, kind: JobKind) -> int:
        query = (
            sa.select(sa.func.count())
            .select_from(jobs)
            .where(jobs.c.kind == kind.value, jobs.c.status == JobStatus.QUEUED.value)
        )
        with self._read() as conn:
            return int(conn.execute(query).scalar_one())

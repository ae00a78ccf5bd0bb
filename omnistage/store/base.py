"""The store interface: what the routes and the job runner need of a database.

One implementation (``sql.SqlStore``) serves SQLite and PostgreSQL through SQLAlchemy;
the schema is versioned and upgraded on start (Alembic). Times are seconds since the
epoch, passed in by the caller (``now``) so expiry and leases are testable without
sleeping. Every read and delete takes ``owner``: a row of another owner is "not found".

Leases make a job run once: ``claim_job`` hands the oldest runnable job to one holder
(atomically; two heads never get the same job), the holder renews the lease while it
runs, and only the lease holder may finish it. A job whose holder died is runnable
again once its lease expires (a re-run: ``attempts`` counts the claims; past
``max_attempts`` the job fails with a reason instead of running again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from omnistage.store.records import Job, JobKind, JobStatus, Page, RealtimeRecord, StoredResponse


class Store(Protocol):
    async def start(self) -> None:
        """Connect and upgrade the schema to this version's (creating it if new)."""

    async def close(self) -> None: ...

    # -- jobs ----------------------------------------------------------------------

    async def create_job(self, job: Job) -> None: ...

    async def get_job(self, job_id: str, owner: str | None) -> Job | None: ...

    async def list_jobs(
        self,
        kind: JobKind,
        owner: str | None,
        *,
        after: str | None = None,
        limit: int = 20,
        newest_first: bool = True,
    ) -> Page:
        """Jobs of ``kind`` after the job ``after`` (exclusive) in the order asked."""

    async def delete_job(self, job_id: str, owner: str | None) -> Job | None:
        """Remove the row; returns it (its media are the caller's to remove)."""

    async def cancel_job(self, job_id: str, owner: str | None, now: float) -> Job | None:
        """A queued or running job becomes cancelled (its holder sees it at its next
        renewal); a finished one is returned unchanged. None: no such job."""

    async def claim_job(
        self,
        kinds: Sequence[JobKind],
        holder: str,
        now: float,
        lease_s: float,
        max_attempts: int,
    ) -> Job | None:
        """The oldest queued job of ``kinds``, or a running one whose lease expired,
        leased to ``holder`` (status in_progress, attempts + 1). An expired job already
        claimed ``max_attempts`` times is failed (code ``interrupted``) instead."""

    async def renew_lease(
        self, job_id: str, holder: str, now: float, lease_s: float, progress: int | None = None
    ) -> bool:
        """Extend the lease (and record progress); False if ``holder`` no longer holds
        it (expired and taken over, cancelled, deleted): the holder must stop."""

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
        """Completed or failed, by the lease holder only (False otherwise)."""

    async def release_leases(self, holder: str) -> int:
        """Make ``holder``'s running jobs runnable now: a restarted head under the same
        name releases what its previous run held (it cannot be running them)."""

    async def queued_jobs(self, kind: JobKind) -> int:
        """How many jobs of ``kind`` wait to be claimed (the autoscaler counts them)."""

    async def expired_jobs(self, now: float, limit: int = 100) -> list[Job]:
        """Finished jobs whose ``expires_at`` has passed (their media are due for removal)."""

    # -- stored responses ------------------------------------------------------------

    async def put_response(self, response: StoredResponse) -> None:
        """Insert, or replace the row with the same id (a background response's
        status changes as it runs)."""

    async def get_response(self, response_id: str, owner: str | None) -> StoredResponse | None: ...

    async def delete_response(self, response_id: str, owner: str | None) -> bool: ...

    # -- saved Realtime sessions -------------------------------------------------------

    async def create_realtime_session(self, record: RealtimeRecord) -> None:
        """Insert a new session (and remove the sessions expired by ``created_at``)."""

    async def save_realtime_session(
        self,
        session_id: str,
        generation: int,
        config: dict[str, Any],
        items: list[dict[str, Any]],
        expires_at: float,
    ) -> bool:
        """Rewrite the session's config and items; False (nothing written) if it has
        been resumed since ``generation``, or is gone."""

    async def resume_realtime_session(
        self, session_id: str, owner: str | None, token_hash: str, now: float
    ) -> RealtimeRecord | None:
        """The session, unexpired, of ``owner``, whose token hashes to ``token_hash``,
        with its generation bumped (the previous connection's saves now fail); None
        otherwise, whichever check failed."""

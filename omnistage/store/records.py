"""The rows the store keeps, as typed values (msgspec Structs, JSON-able).

A ``Job`` is a long generation run as a job (a video, a background response): created
queued by a route, claimed by one head with a lease, run through the pipeline like any
request, and finished with a result (media keys, sizes) or an error. ``request`` holds
what the route validated, so any head can run it again after a restart (with the same
seed: the same result). A ``StoredResponse`` is one turn of the Responses API: its input
items and the response object as it was returned, chained by ``previous_response_id``.

``owner`` is the fingerprint of the API key that created the row (None when the server
has no key): rows are visible only to their owner.

A ``RealtimeRecord`` is a Realtime session as a client may resume it on another API
process or head: its config and conversation, saved as they change, until it expires.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


class JobKind(enum.StrEnum):
    VIDEO = "video"
    RESPONSE = "response"  # a Responses API request with background: true


class ResponseStatus(enum.StrEnum):
    """A Responses API response's status, and its output items' (OpenAI's names)."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def running(self) -> bool:
        """Background work that has not ended: the stored body is not the final one."""
        return self in (ResponseStatus.QUEUED, ResponseStatus.IN_PROGRESS)


class Job(msgspec.Struct, kw_only=True):
    id: str
    kind: JobKind
    owner: str | None
    status: JobStatus = JobStatus.QUEUED
    request: dict[str, Any] = {}
    created_at: float
    progress: int = 0  # percent, 0..100
    attempts: int = 0  # claims so far (a claim after a lost lease is a re-run)
    lease_owner: str | None = None  # the head running it
    lease_until: float | None = None
    started_at: float | None = None
    completed_at: float | None = None
    expires_at: float | None = None  # media removed after this (--media-ttl)
    error: dict[str, Any] | None = None  # {"code": ..., "message": ...}
    result: dict[str, Any] | None = None


class StoredResponse(msgspec.Struct, kw_only=True):
    id: str
    owner: str | None
    created_at: float
    status: ResponseStatus  # the response object's status
    previous_response_id: str | None = None
    # The id of the first response of the chain: turns of one conversation share it
    # (the balancer's affinity key, so they land where the prefix cache holds them).
    conversation: str
    input_items: list[dict[str, Any]] = []  # this turn's input, as input_items lists them
    body: dict[str, Any] = {}  # the response object as returned (output, usage, ...)


class RealtimeRecord(msgspec.Struct, kw_only=True):
    id: str  # the session's id (sess_...)
    owner: str | None
    # SHA-256 of the resume token the session was created with: only its holder resumes.
    token_hash: str
    # Bumped by each resume: the connection that held the session before finds its
    # next save refused, and stops (one live connection per session).
    generation: int = 0
    created_at: float
    expires_at: float  # not resumable after this (each save moves it on)
    config: dict[str, Any] = {}  # the session object as session.updated reports it
    items: list[dict[str, Any]] = []  # the conversation, in order (``realtime.saved``)


class Page(msgspec.Struct):
    """One page of a list, newest or oldest first as asked."""

    items: list[Any]
    has_more: bool

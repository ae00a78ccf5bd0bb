"""Session resume (our extension to the Realtime API): a session's config and items are
saved in the store as they change, so a client whose API process or head died
reconnects with ``?session_id=sess_...`` and its resume token, on any process of any
head sharing the store, and goes on with the same session. The WebSocket's handshake and
a WebRTC call's ``POST /v1/realtime/calls`` take the same parameters, and a session
saved by either resumes over either.

The token is made at creation and sent once, in ``session.created``'s ``resume``; the
store keeps only its SHA-256. A resume must bring it (``resume_token`` query parameter
or the ``X-Omnistage-Resume-Token`` header) and the API key the session was made with
(the row's owner): knowing a session id is not enough. Any failure is the same 404, so a
guesser learns nothing. A resume bumps the row's generation: the connection that held
the session before (alive behind a network split) finds its next save refused, gets an
``error`` (``session_resumed_elsewhere``) and is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import HTTPConnection

from omnistage.api.owner import owner_of
from omnistage.realtime.session import RealtimeSession
from omnistage.store.base import Store
from omnistage.store.records import RealtimeRecord

log = logging.getLogger(__name__)

SESSION_PARAM = "session_id"
TOKEN_PARAM = "resume_token"
TOKEN_HEADER = "x-omnistage-resume-token"
LOST = "this session was resumed on another connection; this one is closed"
LOST_CODE = "session_resumed_elsewhere"


class ResumeRefused(Exception):
    """No session to resume: a status and OpenAI's error fields, as ``Refusal`` has."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def store_of(ws: HTTPConnection, ttl_s: float) -> Store | None:
    """The store sessions are saved in; None where there is none or resume is off."""
    persist = getattr(ws.app.state, "persist", None)
    return persist.store if persist is not None and ttl_s > 0 else None


async def load(ws: HTTPConnection, store: Store | None) -> tuple[RealtimeRecord, str] | None:
    """The saved session a handshake asks to resume, with its token (None: a new one)."""
    session_id = ws.query_params.get(SESSION_PARAM)
    if session_id is None:
        return None
    if store is None:
        raise ResumeRefused(400, "this server keeps no sessions to resume", "resume_unavailable")
    token = ws.query_params.get(TOKEN_PARAM) or ws.headers.get(TOKEN_HEADER) or ""
    record = await store.resume_realtime_session(
        session_id, owner_of(ws), token_hash(token), time.time()
    )
    if record is None:
        message = f"no session {session_id!r} to resume with this key and token (or it expired)"
        raise ResumeRefused(404, message, "session_not_found")
    return record, token


class SessionSaver:
    """Writes one session's config and items to the store as they change: one write at
    a time, each of the latest state, so a burst of events is one or two writes."""

    def __init__(
        self,
        store: Store,
        session: RealtimeSession,
        generation: int,
        ttl_s: float,
        lost: Callable[[], None],
    ) -> None:
        self._store, self._session, self._generation = store, session, generation
        self._ttl_s, self._lost = ttl_s, lost
        self._dirty = self._gone = False
        self._task: asyncio.Future[None] | None = None

    def changed(self) -> None:
        if self._gone:
            return
        self._dirty = True
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while self._dirty:
            self._dirty = False
            config, items = self._session.saved_state()
            try:
                kept = await self._store.save_realtime_session(
                    self._session.id, self._generation, config, items, time.time() + self._ttl_s
                )
            except Exception:  # the session goes on; a resume finds the last save
                log.warning("could not save realtime session %s", self._session.id, exc_info=True)
                continue
            if not kept:
                self._gone, self._dirty = True, False
                self._lost()
                return

    async def close(self) -> None:
        """The connection ends: the last state is written (its expiry counted from now)
        before the slot is freed."""
        self.changed()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._task), 5.0)


async def attach(
    store: Store | None,
    ws: HTTPConnection,
    session: RealtimeSession,
    resumed: tuple[RealtimeRecord, str] | None,
    ttl_s: float,
    lost: Callable[[], None],
) -> tuple[SessionSaver | None, dict[str, Any] | None]:
    """Save ``session`` from now on: its saver, and ``session.created``'s ``resume``
    field. A new session's row is made here; where the store fails the session goes on,
    unsaved (no ``resume`` field: the client knows it cannot resume)."""
    if store is None:
        return None, None
    if resumed is not None:
        record, token = resumed
    else:
        token = secrets.token_urlsafe(32)
        config, items = session.saved_state()
        now = time.time()
        record = RealtimeRecord(
            id=session.id,
            owner=owner_of(ws),
            token_hash=token_hash(token),
            created_at=now,
            expires_at=now + ttl_s,
            config=config,
            items=items,
        )
        try:
            await store.create_realtime_session(record)
        except Exception:
            log.warning("could not save realtime session %s", session.id, exc_info=True)
            return None, None
    saver = SessionSaver(store, session, record.generation, ttl_s, lost)
    session.on_change = saver.changed
    if resumed is not None:
        saver.changed()  # its expiry counts from now
    info = {"token": token, "resumed": resumed is not None, "expires_in": ttl_s}
    return saver, info

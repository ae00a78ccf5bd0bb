"""The saved Realtime sessions' queries of ``SqlStore``.

A session is one row, rewritten as its conversation and config change (the API's saver
coalesces a burst of changes into one write). ``generation`` fences a resume: the
resume bumps it, and a save made under an older generation changes nothing and returns
False, so two connections never both write one session.
"""

from __future__ import annotations

import hmac
from typing import Any

import msgspec
import sqlalchemy as sa

from omnistage.store.database import SqlDatabase, owned
from omnistage.store.records import RealtimeRecord
from omnistage.store.tables import realtime_sessions as rt


class SqlRealtime(SqlDatabase):
    """The saved-session methods of the ``Store``."""

    async def create_realtime_session(self, record: RealtimeRecord) -> None:
        await self._call(self._create_realtime, msgspec.to_builtins(record), record.created_at)

    def _create_realtime(self, row: dict[str, Any], now: float) -> None:
        with self._write() as conn:
            # Sessions past their expiry go as new ones come (indexed on expires_at).
            conn.execute(sa.delete(rt).where(rt.c.expires_at < now))
            conn.execute(sa.insert(rt), row)

    async def save_realtime_session(
        self,
        session_id: str,
        generation: int,
        config: dict[str, Any],
        items: list[dict[str, Any]],
        expires_at: float,
    ) -> bool:
        args = (session_id, generation, config, items, expires_at)
        return await self._call(self._save_realtime, *args)

    def _save_realtime(
        self,
        session_id: str,
        generation: int,
        config: dict[str, Any],
        items: list[dict[str, Any]],
        expires_at: float,
    ) -> bool:
        query = (
            sa.update(rt)
            .where(rt.c.id == session_id, rt.c.generation == generation)
            .values(config=config, items=items, expires_at=expires_at)
        )
        with self._write() as conn:
            return conn.execute(query).rowcount == 1

    async def resume_realtime_session(
        self, session_id: str, owner: str | None, token_hash: str, now: float
    ) -> RealtimeRecord | None:
        return await self._call(self._resume_realtime, session_id, owner, token_hash, now)

    def _resume_realtime(
        self, session_id: str, owner: str | None, token_hash: str, now: float
    ) -> RealtimeRecord | None:
        query = sa.select(rt).where(rt.c.id == session_id, owned(rt, owner), rt.c.expires_at >= now)
        with self._write() as conn:
            row = conn.execute(query).first()
            if row is None or not hmac.compare_digest(row.token_hash, token_hash):
                return None
            bump = (
                sa.update(rt)
                .where(rt.c.id == session_id, rt.c.generation == row.generation)
                .values(generation=row.generation + 1)
            )
            if conn.execute(bump).rowcount != 1:
                return None  # resumed at the same moment by another: that one has it
        record = msgspec.convert(row, RealtimeRecord, from_attributes=True)
        record.generation += 1
        return record

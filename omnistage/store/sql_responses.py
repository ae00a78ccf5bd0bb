"""The stored responses' queries of ``SqlStore``."""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from omnistage.store import engine as db
from omnistage.store.database import SqlDatabase, owned
from omnistage.store.records import StoredResponse
from omnistage.store.tables import responses


@functools.cache
def _upsert_response(on_sqlite: bool) -> sa.Insert:
    """INSERT ... ON CONFLICT (id) DO UPDATE of every other column (built once)."""
    insert = (sqlite if on_sqlite else postgresql).insert(responses)
    changed = {column.name: insert.excluded[column.name] for column in responses.c}
    del changed["id"]
    return insert.on_conflict_do_update(index_elements=["id"], set_=changed)


class SqlResponses(SqlDatabase):
    """The stored-response methods of the ``Store``."""

    async def put_response(self, response: StoredResponse) -> None:
        await self._call(self._put_response, msgspec.to_builtins(response))

    def _put_response(self, row: dict[str, Any]) -> None:
        with self._write() as conn:
            conn.execute(_upsert_response(db.is_sqlite(self.engine)), row)

    async def get_response(self, response_id: str, owner: str | None) -> StoredResponse | None:
        return await self._call(self._get_response, response_id, owner)

    def _get_response(self, response_id: str, owner: str | None) -> StoredResponse | None:
        query = sa.select(responses).where(responses.c.id == response_id, owned(responses, owner))
        with self._read() as conn:
            row = conn.execute(query).first()
        return None if row is None else msgspec.convert(row, StoredResponse, from_attributes=True)

    async def delete_response(self, response_id: str, owner: str | None) -> bool:
        return await self._call(self._delete_response, response_id, owner)

    def _delete_response(self, response_id: str, owner: str | None) -> bool:
        query = sa.delete(responses).where(responses.c.id == response_id, owned(responses, owner))
        with self._write() as conn:
            return conn.execute(query).rowcount == 1

"""``SqlDatabase``: the store's database (SQLAlchemy Core), its calls on threads of its own.

Queries are blocking, so each call runs on a small thread pool of the store's own (not
the loop's default executor, which a slow disk or a held SQLite lock would then starve).
A call whose awaiting task is cancelled still completes in its thread: a claim made for a
caller that is gone is a job whose lease will expire, which the lease design covers.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import sqlalchemy as sa

from omnistage.store import engine as db

T = TypeVar("T")


def owned(table: sa.Table, owner: str | None) -> sa.ColumnElement[bool]:
    """The rows of ``owner`` (None: the rows without one)."""
    return table.c.owner.is_(None) if owner is None else table.c.owner == owner


class SqlDatabase:
    """The database at ``url`` (see ``engine.engine_url`` for the forms it takes): its
    schema upgraded by ``start``; queries run through ``_call``, in a read or write
    transaction."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._sa_url = db.engine_url(url)
        self._engine: sa.Engine | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._start_lock = asyncio.Lock()

    @property
    def engine(self) -> sa.Engine:
        if self._engine is None:
            raise RuntimeError("the store is not started")
        return self._engine

    async def start(self) -> None:
        async with self._start_lock:
            if self._engine is not None:
                return
            engine, workers = db.make_engine(self._sa_url)
            pool = ThreadPoolExecutor(workers, thread_name_prefix="omnistage-store")
            try:
                await asyncio.get_running_loop().run_in_executor(pool, db.upgrade_schema, engine)
            except BaseException:
                pool.shutdown(wait=False)
                engine.dispose()
                raise
            self._engine, self._pool = engine, pool

    async def close(self) -> None:
        async with self._start_lock:
            engine, pool = self._engine, self._pool
            if engine is None or pool is None:
                return
            self._engine = self._pool = None
            await asyncio.get_running_loop().run_in_executor(pool, engine.dispose)
            pool.shutdown(wait=False)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            raise RuntimeError("the store is not started")
        call = functools.partial(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def _read(self) -> AbstractContextManager[sa.Connection]:
        return db.read_transaction(self.engine)

    def _write(self) -> AbstractContextManager[sa.Connection]:
        return db.write_transaction(self.engine)

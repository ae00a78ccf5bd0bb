"""Connections to the store's database: URLs, engines, write transactions, migrations.

SQLite and PostgreSQL differ in how a write transaction keeps out other writers, so that
difference lives here and ``sql.py`` writes its queries once:

- SQLite: several processes (heads, API servers) may share the file. WAL lets readers
  run beside the one writer; ``busy_timeout`` makes a writer wait for the lock instead of
  failing. Python's sqlite3 module would open transactions lazily with a plain BEGIN, so a
  transaction that reads and then writes could fail to upgrade its lock (SQLITE_BUSY,
  which busy_timeout does not retry); write transactions here start with
  ``BEGIN IMMEDIATE`` instead: they take the write lock first, and everything they read
  stays true until they commit.
- PostgreSQL: row locks (``FOR UPDATE SKIP LOCKED``, in the queries) and, for schema
  upgrades, a transaction-scoped advisory lock.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import event
from sqlalchemy.pool import StaticPool

from omnistage.protocol.errors import ConfigError
from omnistage.store.tables import VERSION_TABLE

SQLITE_BUSY_TIMEOUT_MS = 30_000
# Threads (and pooled connections) per store: the event loop hands queries to these.
WORKERS = 4
# pg_advisory_xact_lock's key for schema upgrades (any constant; "omnistag" in ASCII).
_MIGRATION_LOCK = 0x6F6D6E6973746167
_MIGRATIONS = Path(__file__).parent / "migrations"
_IMMEDIATE = "omnistage_immediate"


def engine_url(url: str) -> sa.URL:
    """--store-url as SQLAlchemy's URL: ``sqlite:///PATH`` or a bare path (SQLite), or
    ``postgresql://`` / ``postgres://`` (psycopg 3, unless the URL names a driver)."""
    if "://" not in url:
        if url == ":memory:":
            return sa.URL.create("sqlite")
        return sa.URL.create("sqlite", database=os.path.abspath(os.path.expanduser(url)))
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError as e:
        raise ConfigError("--store-url", f"not a database URL: {url!r} ({e})") from None
    backend = parsed.get_backend_name()
    if backend in ("postgres", "postgresql"):
        driver = parsed.get_driver_name() if "+" in parsed.drivername else "psycopg"
        return parsed.set(drivername=f"postgresql+{driver}")
    if backend == "sqlite":
        return parsed
    raise ConfigError(
        "--store-url", f"unsupported database {backend!r}: use sqlite:///PATH or postgresql://..."
    )


def is_sqlite(engine: sa.Engine) -> bool:
    return engine.dialect.name == "sqlite"


def make_engine(url: sa.URL) -> tuple[sa.Engine, int]:
    """The engine for ``url`` and how many threads may use it at once."""
    json_options: dict[str, Any] = {
        "json_serializer": lambda value: msgspec.json.encode(value).decode(),
        "json_deserializer": msgspec.json.decode,
    }
    if url.get_backend_name() != "sqlite":
        try:
            engine = sa.create_engine(
                url, pool_size=WORKERS, max_overflow=0, pool_pre_ping=True, **json_options
            )
        except ModuleNotFoundError as e:
            raise ConfigError(
                "--store-url", f"PostgreSQL needs {e.name}: pip install 'omnistage[postgres]'"
            ) from None
        return engine, WORKERS
    memory = url.database in (None, "", ":memory:")
    if memory:
        # One connection, or each thread would see a database of its own.
        engine = sa.create_engine(
            url, poolclass=StaticPool, connect_args={"check_same_thread": False}, **json_options
        )
    else:
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(
            url,
            pool_size=WORKERS,
            max_overflow=0,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            **json_options,
        )
    _configure_sqlite(engine, wal=not memory)
    return engine, 1 if memory else WORKERS


def _use_wal(cursor: Any) -> None:
    """Switch the file to WAL (it stays so: later connections find it done). Switching
    needs the file to itself, and SQLite answers "database is locked" at once, without
    its busy handler, while another process holds it (several starting together): retry
    for as long as busy_timeout would have waited."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            mode = cursor.execute("PRAGMA journal_mode").fetchone()[0]
            if str(mode).lower() != "wal":
                cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _configure_sqlite(engine: sa.Engine, wal: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # The driver's own transaction handling off: _on_begin emits BEGIN.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys = ON")
        if wal:
            _use_wal(cursor)
            # In WAL mode NORMAL survives a crash of any process (commits are in the WAL);
            # only a power loss may drop the last commits, never corrupt the file.
            cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        immediate = conn.get_execution_options().get(_IMMEDIATE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


@contextlib.contextmanager
def write_transaction(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A transaction that will write: on SQLite it holds the database's write lock from
    its first statement (see the module docstring). Commits on exit, rolls back on error."""
    with engine.connect() as conn:
        if is_sqlite(engine):
            conn.execution_options(**{_IMMEDIATE: True})
        with conn.begin():
            yield conn


@contextlib.contextmanager
def read_transaction(engine: sa.Engine) -> Iterator[sa.Connection]:
    with engine.connect() as conn, conn.begin():
        yield conn


def upgrade_schema(engine: sa.Engine) -> None:
    """Bring the schema to the newest revision, creating it in an empty database.

    One transaction under a lock, so processes starting together take turns: the first
    upgrades, the others then find the schema current and change nothing. (PostgreSQL and
    SQLite both roll DDL back with the transaction, so a failed upgrade leaves no trace.)
    """
    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    with write_transaction(engine) as conn:
        if not is_sqlite(engine):
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
        _refuse_newer_schema(conn, ScriptDirectory.from_config(config))
        config.attributes["connection"] = conn
        command.upgrade(config, "head")


class SchemaTooNew(RuntimeError):
    """The database was written by a newer omnistage: its revision is not one of ours."""


def _refuse_newer_schema(conn: sa.Connection, scripts: ScriptDirectory) -> None:
    # Alembic's own error ("Can't locate revision ...") does not say what to do; a newer
    # omnistage sharing the store (or one run earlier on the same file) is the usual cause.
    current = _current_revision(conn)
    known = {script.revision for script in scripts.walk_revisions()}
    if current is not None and current not in known:
        raise SchemaTooNew(
            f"its schema is at revision {current!r}, written by a newer omnistage (this "
            f"one knows up to {scripts.get_current_head()!r}): run that version, or point "
            "--store-url at another database"
        )


def _current_revision(conn: sa.Connection) -> str | None:
    context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def schema_revision(engine: sa.Engine) -> str | None:
    """The revision the database is at (None: no schema yet)."""
    with read_transaction(engine) as conn:
        return _current_revision(conn)

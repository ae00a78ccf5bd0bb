"""Alembic's entry point: migrate the connection ``SqlStore.start`` hands over.

There is no offline (SQL script) mode and no URL of its own: the caller opens the
connection, holds the lock that serializes concurrent upgrades, and commits.
"""

from __future__ import annotations

from alembic import context

from omnistage.store.tables import VERSION_TABLE

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("the store's migrations run through SqlStore.start(), with a connection")

context.configure(
    connection=connection,
    version_table=VERSION_TABLE,
    # SQLite alters tables by copying them: later revisions use batch_alter_table.
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()

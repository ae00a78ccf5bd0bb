"""The store's tables as SQLAlchemy Core sees them: what the queries in ``sql.py`` use.

The schema itself is made by the migrations (``migrations/versions``), never by
``metadata.create_all``: a test checks that the two agree. Times are seconds since the
epoch as doubles; the record's JSON-able fields are JSON columns (JSONB on PostgreSQL).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

# Alembic's own table under a name of ours, so a database shared with another
# Alembic-managed application keeps the two version histories apart.
VERSION_TABLE = "omnistage_alembic_version"

# none_as_null: Python's None is SQL NULL (not the JSON text "null").
JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
TIME = sa.Double()

metadata = sa.MetaData()

jobs = sa.Table(
    "jobs",
    metadata,
    sa.Column("id", sa.String(), primary_key=True),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("owner", sa.String(), nullable=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("request", JSON, nullable=False),
    sa.Column("created_at", TIME, nullable=False),
    sa.Column("progress", sa.Integer, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("lease_owner", sa.String(), nullable=True),
    sa.Column("lease_until", TIME, nullable=True),
    sa.Column("started_at", TIME, nullable=True),
    sa.Column("completed_at", TIME, nullable=True),
    sa.Column("expires_at", TIME, nullable=True),
    sa.Column("error", JSON, nullable=True),
    sa.Column("result", JSON, nullable=True),
    # Lists: one owner's jobs of a kind in creation order (id breaks ties).
    sa.Index("ix_jobs_kind_owner_created", "kind", "owner", "created_at", "id"),
    # Claims: the oldest queued job, and running jobs whose lease has expired.
    sa.Index("ix_jobs_status_kind_created", "status", "kind", "created_at", "id"),
    sa.Index("ix_jobs_status_lease", "status", "lease_until"),
    # Clean-up: finished jobs whose media are due for removal.
    sa.Index("ix_jobs_expires", "expires_at"),
)

responses = sa.Table(
    "responses",
    metadata,
    sa.Column("id", sa.String(), primary_key=True),
    sa.Column("owner", sa.String(), nullable=True),
    sa.Column("created_at", TIME, nullable=False),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("previous_response_id", sa.String(), nullable=True),
    sa.Column("conversation", sa.String(), nullable=False),
    sa.Column("input_items", JSON, nullable=False),
    sa.Column("body", JSON, nullable=False),
)

realtime_sessions = sa.Table(
    "realtime_sessions",
    metadata,
    sa.Column("id", sa.String(), primary_key=True),
    sa.Column("owner", sa.String(), nullable=True),
    sa.Column("token_hash", sa.String(64), nullable=False),
    sa.Column("generation", sa.Integer, nullable=False),
    sa.Column("created_at", TIME, nullable=False),
    sa.Column("expires_at", TIME, nullable=False),
    sa.Column("config", JSON, nullable=False),
    sa.Column("items", JSON, nullable=False),
    # Clean-up: sessions no longer resumable.
    sa.Index("ix_realtime_sessions_expires", "expires_at"),
)

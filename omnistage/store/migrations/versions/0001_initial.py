"""The first schema: jobs and stored responses.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Spelled out here rather than imported from tables.py: a revision is history, and must
# keep creating what it created when tables.py has moved on.
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TIME = sa.Double()


def upgrade() -> None:
    op.create_table(
        "jobs",
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
    )
    op.create_index("ix_jobs_kind_owner_created", "jobs", ["kind", "owner", "created_at", "id"])
    op.create_index("ix_jobs_status_kind_created", "jobs", ["status", "kind", "created_at", "id"])
    op.create_index("ix_jobs_status_lease", "jobs", ["status", "lease_until"])
    op.create_index("ix_jobs_expires", "jobs", ["expires_at"])
    op.create_table(
        "responses",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("owner", sa.String(), nullable=True),
        sa.Column("created_at", TIME, nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("previous_response_id", sa.String(), nullable=True),
        sa.Column("conversation", sa.String(), nullable=False),
        sa.Column("input_items", JSON, nullable=False),
        sa.Column("body", JSON, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("responses")
    op.drop_table("jobs")

"""Realtime sessions, saved so a client can resume one on another process or head.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TIME = sa.Double()


def upgrade() -> None:
    op.create_table(
        "realtime_sessions",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("owner", sa.String(), nullable=True),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        sa.Column("expires_at", TIME, nullable=False),
        sa.Column("config", JSON, nullable=False),
        sa.Column("items", JSON, nullable=False),
    )
    op.create_index("ix_realtime_sessions_expires", "realtime_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_table("realtime_sessions")

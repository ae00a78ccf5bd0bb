"""``SqlStore``: the ``Store`` on SQLite or PostgreSQL (SQLAlchemy Core).

One database and thread pool (``database.SqlDatabase``) under the jobs' queries
(``sql_jobs``) and the stored responses' (``sql_responses``).
"""

from __future__ import annotations

from omnistage.store.sql_jobs import SqlJobs
from omnistage.store.sql_responses import SqlResponses


class SqlStore(SqlJobs, SqlResponses):
    """The store at ``url`` (see ``engine.engine_url`` for the forms it takes)."""

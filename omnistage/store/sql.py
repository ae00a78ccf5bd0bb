"""``SqlStore``: the ``Store`` on SQLite or PostgreSQL (SQLAlchemy Core).

One database and thread pool (``database.SqlDatabase``) under the jobs' queries
(``sql_jobs``), the stored responses' (``sql_responses``) and the saved Realtime
sessions' (``sql_realtime``).
"""

from __future__ import annotations

from omnistage.store.sql_jobs import SqlJobs
from omnistage.store.sql_realtime import SqlRealtime
from omnistage.store.sql_responses import SqlResponses


class SqlStore(SqlJobs, SqlResponses, SqlRealtime):
    """The store at ``url`` (see ``engine.engine_url`` for the forms it takes)."""

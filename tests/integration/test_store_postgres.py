"""The store on a real PostgreSQL server (the behaviours in tests/store_cases.py): each
test gets an empty database on the session's server (tests/postgres.py)."""

from __future__ import annotations

import pytest

from tests.postgres import PostgresServer
from tests.store_cases import StoreCases


class TestPostgresStore(StoreCases):
    @pytest.fixture
    def store_url(self, postgres: PostgresServer) -> str:
        return postgres.new_database()

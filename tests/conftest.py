"""Fixtures every test directory may use."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.postgres import PostgresMissingError, PostgresServer, postgres_server, server_bin_dir


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server for the session (tests/postgres.py). Missing binaries
    fail the test rather than skip it: CI installs them (scripts/test.sh)."""
    try:
        server_bin_dir()
    except PostgresMissingError as e:
        pytest.fail(str(e), pytrace=False)
    with postgres_server() as server:
        yield server


@pytest.fixture(scope="session")
def postgres_url(postgres: PostgresServer) -> str:
    """An empty database on the session's server (a test that needs one of its own calls
    ``postgres.new_database()``)."""
    return postgres.create_database("omnistage")

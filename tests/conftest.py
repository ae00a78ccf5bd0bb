"""Fixtures every test directory may use."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.postgres import PostgresMissingError, PostgresServer, postgres_server, server_bin_dir

# The heads tests start keep their jobs, stored responses and media in this session's
# own directory, not in the user's cache (a test that needs a store of its own passes
# --store-url and --media-url).
_STATE = tempfile.mkdtemp(prefix="omnistage-tests-")
os.environ.setdefault("OMNISTAGE_STORE_URL", f"sqlite:///{_STATE}/store.db")
os.environ.setdefault("OMNISTAGE_MEDIA_URL", os.path.join(_STATE, "media"))
# No test reaches a real model hub: a model named by hub id comes from the HF cache, or a
# test's own local endpoint (tests/hf_endpoint.py) with HF_HUB_OFFLINE=0.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# WebRTC calls (POST /v1/realtime/calls) offer only loopback ICE candidates, both ends.
os.environ.setdefault("OMNISTAGE_WEBRTC_HOSTS", "127.0.0.1")


def pytest_sessionfinish() -> None:
    shutil.rmtree(_STATE, ignore_errors=True)


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

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
# --store-url and --media-url). Under pytest-xdist each worker is a session of its own:
# it does not take its controller's directory from the environment it inherits (two
# workers' heads on one store would see each other's jobs), only what the user set.
_STATE = tempfile.mkdtemp(prefix="omnistage-tests-")
_DEFAULTED = "OMNISTAGE_TESTS_DEFAULTED"  # the names set here, not by the user
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in os.environ.get(_DEFAULTED, "").split():
        os.environ.pop(_name, None)
_defaults = {
    "OMNISTAGE_STORE_URL": f"sqlite:///{_STATE}/store.db",
    "OMNISTAGE_MEDIA_URL": os.path.join(_STATE, "media"),
}
os.environ[_DEFAULTED] = " ".join(n for n in _defaults if n not in os.environ)
for _name, _value in _defaults.items():
    os.environ.setdefault(_name, _value)
# No test reaches a real model hub: a model named by hub id comes from the HF cache, or a
# test's own local endpoint (tests/hf_endpoint.py) with HF_HUB_OFFLINE=0.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# WebRTC calls (POST /v1/realtime/calls) offer only loopback ICE candidates, both ends.
os.environ.setdefault("OMNISTAGE_WEBRTC_HOSTS", "127.0.0.1")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``-n N --dist loadgroup`` (scripts/test.sh), a module's tests go to one
    worker, so its module fixtures (a head, a browser) start once; a module may name a
    group it shares with others (``xdist_group``) to keep them off each other's time."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None and item.module is not None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


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

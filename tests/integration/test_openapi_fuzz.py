"""Fuzz every operation of a live head's /openapi.json with schemathesis: whatever the
request, valid or not, the answer is never a 5xx.

The echo pipeline needs no weights, so this runs a real head over real HTTP. Streaming
requests (``stream: true``) stay in: the echo stages finish at once, so the SSE body is
complete and schemathesis reads it as plain bytes (it checks only the status here).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.integration.harness import HeadProc

API_KEY = "fuzz-key"
# Bounded so the whole module runs in well under a minute; each run draws new inputs.
# Health checks off: over real HTTP generation is "too slow" by Hypothesis' standards,
# and negative bodies are filtered heavily; neither says anything about the server.
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
# Every operation of the schema is a subtest of one test function, so the suite's
# per-test limit (120 s) bounds them all together; with the jobs, videos and stored
# responses routes that took ~110 s here alone and over 120 s on a loaded CI machine.
# The examples are bounded above; this only keeps a slow machine from failing them.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def keyed_head(module_tmp: Path) -> Iterator[HeadProc]:
    head = HeadProc(module_tmp, "echo", "--api-key", API_KEY, name="keyed-head")
    try:
        head.wait_healthy()
        yield head
    finally:
        head.stop()


# The dashboard's feed is a server-sent event stream that never ends: every call would
# wait out the client's timeout (90 s of each test), and it takes no input to fuzz
# (tests/integration/test_dashboard.py reads it).
ENDLESS = "/v1/omni/events"


@pytest.fixture
def echo_schema(echo_head: HeadProc) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{echo_head.url}/openapi.json")


@pytest.fixture
def keyed_schema(keyed_head: HeadProc) -> schemathesis.BaseSchema:
    # /openapi.json is outside /v1, so it needs no key.
    return schemathesis.openapi.from_url(f"{keyed_head.url}/openapi.json")


# Filters go on the lazy schema: the fixture's own are not applied to its operations.
echo = schemathesis.pytest.from_fixture("echo_schema").exclude(path=ENDLESS)
keyed = schemathesis.pytest.from_fixture("keyed_schema").exclude(path=ENDLESS)


@echo.parametrize()
@FUZZ
def test_no_server_errors(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=[not_a_server_error], timeout=30)


@keyed.parametrize()
@settings(FUZZ, max_examples=15)
def test_with_an_api_key_no_server_errors(case: schemathesis.Case) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    case.call_and_validate(headers=headers, checks=[not_a_server_error], timeout=30)


@keyed.parametrize()
@settings(FUZZ, max_examples=10)
def test_without_the_key_v1_is_401(case: schemathesis.Case) -> None:
    # Whatever the body, a /v1 request without the key is refused before it is read.
    response = case.call_and_validate(checks=[not_a_server_error], timeout=30)
    if case.path.startswith("/v1/"):
        assert response.status_code == 401, response.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # Found by this fuzzing: each was a 500.
        ({"prompt": "x", "max_completion_tokens": 2**64}, "max_completion_tokens"),
        ({"prompt": "x", "stage_params": {"0": {"n": -(2**64)}}}, "stage_params"),
        ({"prompt": "x", "stage_params": {"\u00b3": {}}}, "stage_params"),
    ],
)
def test_inputs_once_found_to_be_500s_are_400s(echo_head: HeadProc, body: dict, param: str) -> None:
    r = echo_head.client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param

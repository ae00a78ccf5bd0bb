"""Request-body bounds and the error shape of unexpected failures, on a fake head."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from omnistage.api.app import create_app
from tests.unit.fakes import FakeService

HUGE = 2**64  # msgpack has no integer this large


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": HUGE}, "max_tokens"),
        ({"max_completion_tokens": HUGE}, "max_completion_tokens"),
        ({"top_k": HUGE}, "top_k"),
        ({"seed": -HUGE}, "seed"),
        ({"stage_params": {"0": {"a": [1, {"b": HUGE}]}}}, "stage_params"),
    ],
)
def test_integers_too_big_to_send_to_a_replica_are_a_400(extra: dict, param: str) -> None:
    with TestClient(create_app(FakeService())) as client:
        r = client.post("/v1/completions", json={"prompt": "x", **extra})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_an_unexpected_error_is_a_500_in_openai_shape() -> None:
    async def broken(*_: Any, **__: Any) -> None:
        raise OverflowError("boom")

    app = create_app(FakeService(opener=broken))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={"prompt": "x"})
        metrics = client.get("/metrics").text
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "internal error: OverflowError",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert 'omnistage_http_responses_total{code="500"} 1' in metrics

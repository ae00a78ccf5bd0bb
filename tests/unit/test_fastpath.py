"""The generation routes' fast path: the same middleware, answers and documentation as
through FastAPI, with a stand-in service (no head)."""

from __future__ import annotations

from starlette.testclient import TestClient

from omnistage.api.app import create_app
from omnistage.api.fastpath import FastPaths
from tests.unit.fakes import FakeService


def test_the_fast_path_keeps_the_key_check_errors_and_counts() -> None:
    app = create_app(FakeService(), api_key="k")
    assert isinstance(app, FastPaths)
    with TestClient(app) as client:
        no_key = client.post("/v1/chat/completions", json={"messages": []})
        assert no_key.status_code == 401
        assert no_key.json()["error"]["code"] == "invalid_api_key"
        key = {"Authorization": "Bearer k"}
        bad = client.post("/v1/completions", json={"prompt": 3}, headers=key)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        metrics = client.get("/metrics").text
    assert 'omnistage_http_responses_total{code="401"} 1' in metrics
    assert 'omnistage_http_responses_total{code="400"} 1' in metrics


def test_other_methods_and_routes_are_fastapis_and_the_docs_list_the_fast_routes() -> None:
    with TestClient(create_app(FakeService())) as client:
        assert client.get("/v1/chat/completions").status_code == 405
        paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/audio/speech"):
        assert "post" in paths[path]

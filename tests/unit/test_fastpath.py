"""The generation routes' fast path: the same middleware, answers and documentation as
through FastAPI, with a stand-in service (no head)."""

from __future__ import annotations

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.testclient import TestClient

from omnistage.api.app import create_app
from omnistage.api.fastpath import FastPathMiddleware, FastRoute
from tests.unit.fakes import FakeService

GENERATION_PATHS = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/audio/speech",
    "/v1/images/generations",
}


def test_the_generation_routes_are_declared_fast_in_the_apps_route_table() -> None:
    app = create_app(FakeService())
    assert {r.path for r in app.routes if isinstance(r, FastRoute)} == GENERATION_PATHS


def test_fast_posts_go_to_their_handler_and_everything_else_on_to_the_app() -> None:
    class Body(BaseModel):
        x: int = 0

    async def handler(request: Request) -> Response:
        return PlainTextResponse("fast")

    rest = PlainTextResponse("rest")  # a response is an ASGI app
    client = TestClient(FastPathMiddleware(rest, [FastRoute("/f", handler, Body)]))
    assert client.post("/f").text == "fast"
    assert client.get("/f").text == "rest"
    assert client.post("/g").text == "rest"


def test_the_fast_path_keeps_the_key_check_errors_and_counts() -> None:
    app = create_app(FakeService(), api_key="k")
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

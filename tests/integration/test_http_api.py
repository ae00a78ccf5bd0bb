"""The built-in pipelines end to end over real HTTP, with raw HTTP and the openai client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.harness import HeadProc


def _sse_events(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            events.append({"done": True})
        else:
            events.append(json.loads(data))
    return events


def test_chat_completion_runs_every_stage_in_order(echo_head: HeadProc) -> None:
    r = echo_head.chat("hello world", model="echo")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "echo"
    choice = body["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": "hello world [thinker] [talker] [vocoder]",
    }
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["prompt_tokens"] == 2
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_streamed_chat_delivers_chunks_then_finish_then_done(echo_head: HeadProc) -> None:
    body = {
        "messages": [{"role": "user", "content": "stream me"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with echo_head.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
    assert events[-1] == {"done": True}
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "stream me [thinker] [talker] [vocoder]"
    # (Pieces produced in the same instant may arrive merged; chunk-by-chunk streaming
    # of slower stages is checked in test_streaming_and_load.)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 2


def test_openai_client_non_streaming_and_streaming(echo_head: HeadProc) -> None:
    client = openai.OpenAI(base_url=f"{echo_head.url}/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "from the sdk"}]
    )
    assert out.choices[0].message.content == "from the sdk [thinker] [talker] [vocoder]"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.prompt_tokens == 3
    pieces = []
    finish = None
    for chunk in client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "sdk stream"}], stream=True
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == "sdk stream [thinker] [talker] [vocoder]"
    assert finish == "stop"
    models = client.models.list()
    assert [m.id for m in models.data] == ["echo"]


def test_models_lists_the_pipeline_and_its_stages(echo_head: HeadProc) -> None:
    body = echo_head.client.get("/v1/models").json()
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == "echo"
    assert [s["name"] for s in model["stages"]] == ["thinker", "talker", "vocoder"]
    assert model["output_modalities"] == ["text"]


def test_one_model_by_id_as_the_openai_client_retrieves_it(echo_head: HeadProc) -> None:
    client = openai.OpenAI(base_url=f"{echo_head.url}/v1", api_key="x")
    model = client.models.retrieve("echo")
    assert (model.id, model.object, model.owned_by) == ("echo", "model", "omnistage")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_health_and_stage_listing_when_everything_is_up(echo_head: HeadProc) -> None:
    assert echo_head.client.get("/health").json() == {"status": "ok"}
    stages = echo_head.stages()["stages"]
    assert [s["stage_id"] for s in stages] == [0, 1, 2]
    for stage in stages:
        assert stage["status"] == "ready"
        (replica,) = stage["replicas"]
        assert replica["state"] == "UP"
        assert replica["local"] is True
        assert replica["address"]
        assert replica["last_heartbeat_age_s"] < 3.0
        assert {"queue_length", "in_flight", "capacity", "epoch"} <= replica.keys()


@pytest.mark.parametrize(
    ("body", "status", "param_part"),
    [
        ({}, 400, "messages"),
        ({"messages": []}, 400, "messages"),
        ({"messages": "hi"}, 400, "messages"),
        ({"messages": [{"role": "user"}]}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
        (
            {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            400,
            "temperature",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4o"}, 404, "model"),
        (
            {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
            400,
            "modalities",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "stage_params": {"nope": {}}},
            400,
            "stage_params",
        ),
    ],
)
def test_bad_requests_get_openai_error_bodies(
    echo_head: HeadProc, body: dict, status: int, param_part: str
) -> None:
    r = echo_head.client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param_part in (error["param"] or "") + error["message"]


def test_malformed_json_is_a_400_not_a_500(echo_head: HeadProc) -> None:
    r = echo_head.client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def test_unknown_route_is_a_404_in_openai_shape(echo_head: HeadProc) -> None:
    r = echo_head.client.get("/v1/nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


@pytest.fixture(scope="module")
def fanout_head(module_tmp: Path) -> Iterator[HeadProc]:
    head = HeadProc(module_tmp, "echo-fanout", name="fanout-head")
    try:
        head.wait_healthy()
        yield head
    finally:
        head.stop()


def test_fan_out_returns_both_final_outputs(fanout_head: HeadProc) -> None:
    r = fanout_head.chat("plan", model="echo-fanout")
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["message"]["content"] == "plan [planner] [writer]"
    assert choices[1]["message"]["content"] == "plan [planner] [critic]"


def test_fan_out_streams_both_final_outputs_by_choice_index(fanout_head: HeadProc) -> None:
    body = {"messages": [{"role": "user", "content": "go"}], "stream": True}
    with fanout_head.client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = _sse_events(r)
    texts: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                finished.add(c["index"])
    assert texts == {0: "go [planner] [writer]", 1: "go [planner] [critic]"}
    assert finished == {0, 1}


def test_completions_endpoint_streaming_and_not(echo_head: HeadProc) -> None:
    r = echo_head.client.post("/v1/completions", json={"model": "echo", "prompt": "plain text"})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "plain text [thinker] [talker] [vocoder]"
    body = {"prompt": "streamed text", "stream": True, "stream_options": {"include_usage": True}}
    with echo_head.client.stream("POST", "/v1/completions", json=body) as s:
        events = _sse_events(s)
    assert events[-1] == {"done": True}
    text = "".join(c["choices"][0]["text"] for c in events[:-1] if c["choices"])
    assert text == "streamed text [thinker] [talker] [vocoder]"
    finishes = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]]
    assert finishes[-1] == "stop"
    assert events[-2]["usage"]["prompt_tokens"] == 2

"""What the pipeline cannot honour is a 400 naming the field (or a 404 for endpoints it
does not serve), never a silent drop: the table of unsupported requests in
docs/api/not-supported.md, over real HTTP to an echo pipeline."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.harness import HeadProc

HI = [{"role": "user", "content": "hi"}]
FN = {"type": "function", "function": {"name": "f"}}
PNG_URL = "data:image/png;base64,iVBORw0KGgo="


def _asking(part: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {
                                "type": "input_audio",
                                "input_audio": {"data": "UklGRg==", "format": "wav"},
                            },
                        ],
                    }
                ]
            },
            "messages.0.content",
        ),
        # A part the pipeline cannot take is named by its place: echo reads no images.
        (
            "/v1/chat/completions",
            {"messages": [_asking({"type": "image_url", "image_url": {"url": PNG_URL}})]},
            "messages.0.content.1",
        ),
        (
            "/v1/chat/completions",
            {"messages": [_asking({"type": "video_url", "video_url": {"url": "https://x/y"}})]},
            "messages.0.content.1",
        ),
        (
            "/v1/chat/completions",
            {"messages": [_asking({"type": "file", "file": {"file_id": "f"}})]},
            "messages.0.content.1",
        ),
        ("/v1/chat/completions", {"messages": HI, "n": 2}, "n"),
        (
            "/v1/chat/completions",
            {"messages": HI, "tools": [{"type": "web_search"}]},
            "tools.0.type",
        ),
        ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {
                "messages": HI,
                "tools": [FN],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": HI, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": HI, "response_format": {"type": "grammar"}},
            "response_format.type",
        ),
        (
            "/v1/chat/completions",
            {"messages": HI, "response_format": {"type": "json_schema"}},
            "response_format",
        ),
        ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
    ],
)
def test_unsupported_fields_are_400s_naming_them(
    echo_head: HeadProc, path: str, body: dict[str, Any], param: str
) -> None:
    r = echo_head.client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


@pytest.mark.parametrize(
    "path", ["/v1/audio/transcriptions", "/v1/images/generations", "/v1/embeddings"]
)
def test_endpoints_this_pipeline_cannot_serve_are_404s(echo_head: HeadProc, path: str) -> None:
    # The echo pipeline has no listener, no painter, no embedding stage.
    r = echo_head.client.post(path, json={"prompt": "a cat", "input": "hi", "model": "echo"})
    assert r.status_code == 404, r.text


def test_fields_that_do_not_change_the_answer_are_accepted(echo_head: HeadProc) -> None:
    body = {
        "messages": HI,
        "user": "u1",
        "store": False,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "parallel_tool_calls": False,
        "reasoning_effort": "low",
        "min_tokens": 1,
        "ignore_eos": False,
    }
    r = echo_head.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith("hi")

"""A chat's image and video parts, and a response's video parts: the schema, which parts
a pipeline refuses (naming the part), data URLs, http(s) URLs fetched only from allowed
hosts (a real server on 127.0.0.1), and the thinker's image preparation."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from omnistage.api.media_parts import MediaFetch, media_bytes, media_parts, response_videos
from omnistage.api.schemas.chat import ChatCompletionRequest, ContentPart
from omnistage.api.schemas.responses import ResponsesRequest
from omnistage.config.load import load_config
from omnistage.dataplane.graph import StageGraph
from omnistage.protocol.errors import ApiError
from tests.omni_tiny import mp4, png

PICTURE = png()
DATA_URL = "data:image/png;base64," + base64.b64encode(PICTURE).decode()
CLIP = mp4()
VIDEO_URL = "data:video/mp4;base64," + base64.b64encode(CLIP).decode()
NO_FETCH = MediaFetch()  # the default: data: URLs only


def _chat(*messages: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": list(messages)})


def _image(url: str = DATA_URL) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _video(url: str = VIDEO_URL) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def _asked(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}


@pytest.fixture(scope="module")
def omni_graph(tmp_path_factory: pytest.TempPathFactory) -> StageGraph:
    directory = tmp_path_factory.mktemp("omni")
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))
    return StageGraph(load_config(str(directory)))


def _refusal(body: ChatCompletionRequest, graph: StageGraph) -> ApiError:
    with pytest.raises(ApiError) as info:
        media_parts(body, graph, "p")
    assert info.value.status == 400
    return info.value


def test_an_image_part_parses_and_alone_is_content() -> None:
    body = _chat({"role": "user", "content": [_image()]})
    part = body.messages[0].media_parts()[0]
    assert part.image_url is not None and part.image_url.url == DATA_URL
    with pytest.raises(ValidationError, match="an image_url part needs an image_url object"):
        ContentPart.model_validate({"type": "image_url"})


def test_the_omni_pipeline_takes_the_last_user_messages_images_and_videos(
    omni_graph: StageGraph,
) -> None:
    body = _chat(_asked(_image(), _video(), _image()))
    assert [(where, part.type) for where, part in media_parts(body, omni_graph, "p")] == [
        ("messages.0.content.1", "image_url"),
        ("messages.0.content.2", "video_url"),
        ("messages.0.content.3", "image_url"),
    ]


@pytest.mark.parametrize(
    ("messages", "where", "says"),
    [
        ([_asked({"type": "file", "file": {}})], "0.content.1", "'file'"),
        (
            [_asked(_image()), {"role": "assistant", "content": "A cat."}, _asked()],
            "0.content.1",
            "last user message",
        ),
        (
            [_asked(_video()), {"role": "assistant", "content": "A cat."}, _asked()],
            "0.content.1",
            "may carry videos",
        ),
    ],
)
def test_parts_the_omni_pipeline_cannot_take_are_400s_naming_them(
    omni_graph: StageGraph, messages: list[dict[str, Any]], where: str, says: str
) -> None:
    error = _refusal(_chat(*messages), omni_graph)
    assert error.param == f"messages.{where}"
    assert says in error.message


@pytest.mark.parametrize(("part", "kind"), [(_image(), "images"), (_video(), "videos")])
def test_a_pipeline_without_a_reader_refuses_images_and_videos(
    part: dict[str, Any], kind: str
) -> None:
    error = _refusal(_chat(_asked(part)), StageGraph(load_config("echo")))
    assert error.param == "messages.0.content.1"
    assert f"no stage that takes {kind}" in error.message


def _response(*items: dict[str, Any]) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": list(items)})


def _watch(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, *parts]}


def test_a_response_takes_chats_video_part_in_its_last_user_message(
    omni_graph: StageGraph,
) -> None:
    body = _response({"role": "user", "content": [_video()]})  # a video alone is content
    assert response_videos(body, omni_graph, "p") == [("input.0.content.0", VIDEO_URL)]
    body = _response(_watch(), {"role": "assistant", "content": "A cat."}, _watch(_video()))
    assert response_videos(body, omni_graph, "p") == [("input.2.content.1", VIDEO_URL)]


@pytest.mark.parametrize("part", ["input_video", "input_image", "input_file"])
def test_a_responses_media_part_of_another_name_is_refused_pointing_at_video_url(
    part: str,
) -> None:
    with pytest.raises(ValidationError, match="video_url") as info:
        _response(_watch({"type": part, "video_url": VIDEO_URL}))
    assert part in str(info.value)
    with pytest.raises(ValidationError, match="a video_url part needs video_url"):
        _response(_watch({"type": "video_url"}))


def test_a_responses_video_where_it_cannot_be_watched_is_a_400_naming_it(
    omni_graph: StageGraph,
) -> None:
    earlier = _response(_watch(_video()), {"role": "assistant", "content": "A cat."}, _watch())
    with pytest.raises(ApiError, match="may carry videos") as info:
        response_videos(earlier, omni_graph, "p")
    assert info.value.param == "input.0.content.1"
    with pytest.raises(ApiError, match="no stage that takes videos") as info:
        response_videos(_response(_watch(_video())), StageGraph(load_config("echo")), "p")
    assert info.value.param == "input.0.content.1"


def _bytes_of(url: str, fetch: MediaFetch = NO_FETCH, video: bool = False) -> bytes:
    part = ContentPart.model_validate(_video(url) if video else _image(url))
    return asyncio.run(media_bytes("messages.0.content.1", part, fetch))


def _refused(url: str, fetch: MediaFetch = NO_FETCH, video: bool = False) -> str:
    with pytest.raises(ApiError) as info:
        _bytes_of(url, fetch, video)
    assert info.value.param == "messages.0.content.1"
    return info.value.message


def test_a_data_url_carries_the_image() -> None:
    assert _bytes_of(DATA_URL) == PICTURE
    assert "base64" in _refused("data:image/png,abc")
    assert "image/*" in _refused("data:text/plain;base64,aGk=")
    assert "cannot be read" in _refused("data:image/png;base64,aGVsbG8=")


def test_a_data_url_carries_the_video() -> None:
    assert _bytes_of(VIDEO_URL, video=True) == CLIP
    assert "video/*" in _refused(DATA_URL, video=True)
    assert "video cannot be read" in _refused("data:video/mp4;base64,aGVsbG8=", video=True)


class _Files(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/picture.png")
            self.end_headers()
            return
        body = {"/picture.png": PICTURE, "/big.png": PICTURE * 8, "/clip.mp4": CLIP}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def files() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_http_url_is_fetched_only_from_an_allowed_host(files: str) -> None:
    allowed = MediaFetch(("127.0.0.1",), timeout_s=5, max_bytes=len(PICTURE) * 2)
    assert _bytes_of(f"{files}/picture.png", allowed) == PICTURE
    assert "--allowed-media-domains" in _refused(f"{files}/picture.png")
    assert "--allowed-media-domains" in _refused(
        f"{files}/picture.png", MediaFetch(("example.com",))
    )
    assert "larger than" in _refused(f"{files}/big.png", allowed)
    assert "HTTP 404" in _refused(f"{files}/nothing.png", allowed)
    assert "HTTP 302" in _refused(f"{files}/moved", allowed)  # redirects are not followed
    assert "data: URL or an http(s) URL" in _refused("ftp://127.0.0.1/x.png", allowed)
    video = MediaFetch(("127.0.0.1",), timeout_s=5, max_bytes=len(CLIP))
    assert _bytes_of(f"{files}/clip.mp4", video, video=True) == CLIP
    assert "fetch videos" in _refused(f"{files}/clip.mp4", video=True)


def test_the_thinker_prepares_images_as_qwen2_5_omnis_processor(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import Qwen2VLImageProcessor

    from omnistage.engines.omni import vision_in
    from omnistage.protocol.errors import BadRequestError

    processor = vision_in.load_processor(str(tmp_path))  # no config: the defaults
    seen = vision_in.prepare(processor, [png(56, 56), png(84, 56, seed=1)])
    assert seen.grid.tolist() == [[1, 4, 4], [1, 4, 6]]  # 14-pixel patches
    assert seen.tokens() == [4, 6]  # 2 x 2 patches to a token
    assert seen.placeholder() == (
        "<|vision_bos|>" + "<|IMAGE|>" * 4 + "<|vision_eos|>"
        "<|vision_bos|>" + "<|IMAGE|>" * 6 + "<|vision_eos|>"
    )
    want = Qwen2VLImageProcessor()(images=vision_in.decoded([png(56, 56)]), return_tensors="pt")
    assert seen.pixels[:16].equal(want["pixel_values"])
    with pytest.raises(BadRequestError, match="image 0"):
        vision_in.prepare(processor, [b"not an image"])

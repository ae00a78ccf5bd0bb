"""/v1/videos with the official openai SDK over a real head serving the built-in
``video`` pipeline on a tiny random-weight Wan (tests/video_tiny.py): jobs created,
polled with progress, downloaded as an MP4 that PyAV decodes to the asked size, frame
count and fps; listed, deleted, refused; and a head killed mid-job that, started again
on the same store, makes the very same video."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.harness import HeadProc, free_port, wait_for
from tests.video_tiny import build_tiny_video_pipeline

# The SDK marks its video methods deprecated (OpenAI's own service is closing); the
# API they speak is what this server serves.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
]

av = pytest.importorskip("av")
Image = pytest.importorskip("PIL.Image")

SMALL = {"size": "32x32", "seconds": "1"}
SMALL_EXTRA = {"fps": 4, "steps": 3}


@pytest.fixture(scope="module")
def tiny_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_video_pipeline(tmp_path_factory.mktemp("video") / "tiny-wan")


def _head(tmp: Path, model: Path, name: str, *extra: str, port: int | None = None) -> HeadProc:
    overrides = {"0": {"engine_args": {"model": str(model), "warmup": False}}}
    return HeadProc(
        tmp,
        "video",
        "--stage-overrides",
        json.dumps(overrides),
        "--store-url",
        f"sqlite:///{tmp / 'videos.db'}",
        "--media-url",
        str(tmp / "media"),
        *extra,
        name=name,
        port=port,
    )


@pytest.fixture(scope="module")
def head(module_tmp: Path, tiny_video: Path) -> Iterator[HeadProc]:
    h = _head(module_tmp, tiny_video, "videos")
    try:
        h.wait_healthy(timeout=120)
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("videos")


def _sdk(head: HeadProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{head.url}/v1", api_key="x", max_retries=0, timeout=60)


def _decode(mp4: bytes) -> dict[str, Any]:
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        frames = [f for f in container.decode(stream)]
        return {
            "codec": stream.codec_context.name,
            "size": (frames[0].width, frames[0].height),
            "frames": len(frames),
            "rate": stream.average_rate,
        }


def test_create_and_poll_then_download_gives_the_asked_video(head: HeadProc) -> None:
    sdk = _sdk(head)
    video = sdk.videos.create_and_poll(
        model="video", prompt="a red ball bouncing", **SMALL, extra_body=SMALL_EXTRA
    )
    assert video.status == "completed", video.error
    assert (video.progress, video.size, video.seconds) == (100, "32x32", "1.25")
    assert video.completed_at and video.expires_at and video.expires_at > video.completed_at
    mp4 = sdk.videos.download_content(video.id).content
    # 1 s at 4 fps asks for 4 frames; Wan makes 4k+1, so 5 (1.25 s).
    assert _decode(mp4) == {"codec": "h264", "size": (32, 32), "frames": 5, "rate": Fraction(4)}
    thumb = sdk.videos.download_content(video.id, variant="thumbnail").content
    image = Image.open(io.BytesIO(thumb))
    assert (image.format, image.size) == ("PNG", (32, 32))


def test_progress_climbs_while_the_job_runs(head: HeadProc) -> None:
    sdk = _sdk(head)
    made = sdk.videos.create(
        model="video", prompt="slow", **SMALL, extra_body={"fps": 4, "steps": 300}
    )
    seen: list[tuple[str, int]] = []

    def finished() -> bool:
        got = sdk.videos.retrieve(made.id)
        seen.append((got.status, got.progress))
        return got.status in ("completed", "failed")

    wait_for(finished, 120, 0.05, "the job done")
    assert seen[-1] == ("completed", 100)
    running = [p for s, p in seen if s == "in_progress"]
    assert any(0 < p < 100 for p in running), seen
    assert running == sorted(running)  # it never goes back


def test_a_seed_gives_the_same_video_every_time(head: HeadProc) -> None:
    sdk = _sdk(head)
    extra = {**SMALL_EXTRA, "seed": 1234}
    a = sdk.videos.create_and_poll(model="video", prompt="same", **SMALL, extra_body=extra)
    b = sdk.videos.create_and_poll(model="video", prompt="same", **SMALL, extra_body=extra)
    assert a.id != b.id
    assert sdk.videos.download_content(a.id).content == sdk.videos.download_content(b.id).content


def test_list_pages_newest_first_and_delete_removes_job_and_media(head: HeadProc) -> None:
    sdk = _sdk(head)
    ids = [
        sdk.videos.create(model="video", prompt=f"clip {n}", **SMALL, extra_body=SMALL_EXTRA).id
        for n in range(3)
    ]
    page = sdk.videos.list(limit=2)
    assert [v.id for v in page.data] == [ids[2], ids[1]] and page.has_more
    rest = sdk.videos.list(limit=2, after=ids[1])
    assert rest.data[0].id == ids[0]
    oldest_first = [v.id for v in sdk.videos.list(order="asc", limit=100).data]
    assert oldest_first.index(ids[0]) < oldest_first.index(ids[2])
    done = sdk.videos.poll(ids[0])
    assert done.status == "completed"
    deleted = sdk.videos.delete(ids[0])
    assert deleted.deleted and deleted.id == ids[0]
    with pytest.raises(openai.NotFoundError):
        sdk.videos.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        sdk.videos.download_content(ids[0])
    assert not list((Path(head.log_path).parent / "media").rglob(f"{ids[0]}*"))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"size": "31x32"}, "size"),
        ({"size": "4096x4096"}, "size"),
        ({"seconds": "0"}, "seconds"),
        ({"seconds": "600"}, "seconds"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    head: HeadProc, fields: dict[str, str], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _sdk(head).videos.create(model="video", prompt="x", **fields)  # type: ignore[arg-type]
    assert info.value.body["param"] == param  # type: ignore[index]


def test_an_input_reference_that_is_not_a_file_is_a_400(head: HeadProc) -> None:
    form = {"prompt": "x", "input_reference": "https://example.com/a.png"}
    r = head.client.post("/v1/videos", data=form)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"


def test_content_of_a_video_not_yet_made_is_a_409(head: HeadProc) -> None:
    sdk = _sdk(head)
    made = sdk.videos.create(model="video", prompt="wait", **SMALL, extra_body={"steps": 200})
    r = head.client.get(f"/v1/videos/{made.id}/content")
    assert r.status_code == 409 and r.json()["error"]["code"] == "video_not_ready"
    sdk.videos.delete(made.id)


def test_an_input_reference_on_a_text_only_pipeline_fails_the_job_naming_it(
    head: HeadProc,
) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buf, format="PNG")
    sdk = _sdk(head)
    made = sdk.videos.create(
        model="video",
        prompt="animate",
        input_reference=("first.png", buf.getvalue(), "image/png"),
        **SMALL,
        extra_body=SMALL_EXTRA,
    )
    done = sdk.videos.poll(made.id)
    assert done.status == "failed"
    assert done.error is not None and "input_reference" in done.error.message


def test_a_head_killed_mid_job_makes_the_same_video_when_started_again(
    tmp_path: Path, tiny_video: Path
) -> None:
    port = free_port()
    first = _head(tmp_path, tiny_video, "first", port=port)
    extra = {"fps": 4, "steps": 400, "seed": 77}
    try:
        first.wait_healthy(timeout=120)
        sdk = _sdk(first)
        made = sdk.videos.create(model="video", prompt="again", **SMALL, extra_body=extra)
        wait_for(lambda: sdk.videos.retrieve(made.id).progress > 5, 60, 0.05, "it runs")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.stop()
    again = _head(tmp_path, tiny_video, "again", port=port)
    try:
        again.wait_healthy(timeout=120)
        sdk = _sdk(again)
        rerun = sdk.videos.poll(made.id)
        assert rerun.status == "completed", rerun.error
        fresh = sdk.videos.create_and_poll(model="video", prompt="again", **SMALL, extra_body=extra)
        assert sdk.videos.download_content(rerun.id).content == (
            sdk.videos.download_content(fresh.id).content
        )
    finally:
        again.stop()
    time.sleep(0)

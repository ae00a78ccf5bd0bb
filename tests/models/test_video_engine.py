"""The video engine on tiny random-weight Wan pipelines (text-to-video and
image-to-video): in-process, through a real head and replica process by a
PipelineRequest, and served by ``omnistage serve video``."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from omnistage.config.load import load_config
from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest
from omnistage.engines.video.engine import VideoEngine
from omnistage.protocol.chunk_meta import ImageMeta, ProgressMeta, VideoMeta
from omnistage.protocol.errors import BadRequestError, EngineError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import Prompt
from tests import params as P
from tests.integration.harness import HeadProc
from tests.integration.inproc_head import running_head
from tests.video_tiny import build_tiny_i2v_pipeline, build_tiny_video_pipeline

pytestmark = pytest.mark.slow

av = pytest.importorskip("av")
PIL = pytest.importorskip("PIL.Image")
STEPS = 3


@pytest.fixture(scope="module")
def tiny_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_video_pipeline(tmp_path_factory.mktemp("video") / "tiny-wan")


@pytest.fixture(scope="module")
def tiny_i2v(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_i2v_pipeline(tmp_path_factory.mktemp("video") / "tiny-wan-i2v")


def _stage(model: Path | None, **engine_args: Any) -> StageConfig:
    args: dict[str, Any] = {"num_inference_steps": STEPS, "warmup": False, **engine_args}
    if model is not None:
        args["model"] = str(model)
    return StageConfig(
        stage_id=0,
        name="video",
        engine="video",
        output_modality="video",
        final_output=True,
        engine_args=args,
    )


async def _engine(model: Path, **engine_args: Any) -> VideoEngine:
    engine = VideoEngine(_stage(model, **engine_args))
    await engine.start()
    return engine


async def _nothing() -> AsyncIterator[Any]:
    return
    yield


def _request(params: dict[str, Any], prompt: str = "a red cat", **prompt_fields: Any) -> Any:
    return EngineRequest("req-1", Prompt(text=prompt, **prompt_fields), P.video(params), _nothing())


async def _run(engine: VideoEngine, params: dict[str, Any], **prompt: Any) -> list[EngineChunk]:
    return [chunk async for chunk in engine.generate(_request(params, **prompt))]


def _mp4(chunks: list[EngineChunk]) -> bytes:
    assert chunks[-1].finished and chunks[-1].meta is not None
    assert chunks[-1].meta.format == "mp4"
    return chunks[-1].data


def _decoded(data: bytes) -> dict[str, Any]:
    """What a player sees in an MP4: codec, size, rate and every frame (RGB arrays)."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return {
            "codec": stream.codec_context.name,
            "pix_fmt": stream.codec_context.pix_fmt,
            "size": (stream.codec_context.width, stream.codec_context.height),
            "rate": stream.average_rate,
            "frames": frames,
        }


def _png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    buf = io.BytesIO()
    PIL.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


# -- the engine, in-process ------------------------------------------------------------


async def test_an_h264_mp4_of_the_asked_size_frames_and_fps_after_its_thumbnail(
    tiny_video: Path,
) -> None:
    engine = await _engine(tiny_video)
    chunks = await _run(engine, {"size": "64x32", "num_frames": 9, "fps": 8, "seed": 7})
    thumb, video = chunks
    assert (thumb.modality, video.modality) == ("image", "video")
    assert not thumb.finished and video.finished and video.finish_reason == "stop"
    assert thumb.meta == ImageMeta(format="png", width=64, height=32)
    assert video.meta == VideoMeta(format="mp4", width=64, height=32, frames=9, fps=8, seed=7)
    assert video.usage is not None and video.usage.prompt_tokens > 0
    seen = _decoded(video.data)
    assert (seen["codec"], seen["pix_fmt"], seen["size"]) == ("h264", "yuv420p", (64, 32))
    assert seen["rate"] == Fraction(8) and len(seen["frames"]) == 9
    # The thumbnail is the first frame (the video's is after lossy H.264).
    first = PIL.open(io.BytesIO(thumb.data))
    assert (first.format, first.size) == ("PNG", (64, 32))
    import numpy as np

    drift = np.abs(np.asarray(first.convert("RGB"), int) - seen["frames"][0].astype(int))
    assert drift.mean() < 12


async def test_seconds_at_fps_round_to_the_nearest_length_the_vae_makes(
    tiny_video: Path,
) -> None:
    engine = await _engine(tiny_video)
    # 1 s at 8 fps is 8 frames; Wan makes 4k+1: 9. 0.5 s at 6 fps is 3: 5.
    for params, frames in (({"seconds": 1, "fps": 8}, 9), ({"seconds": 0.5, "fps": 6}, 5)):
        chunks = await _run(engine, {**params, "size": "32x32", "seed": 1})
        assert chunks[-1].meta is not None and chunks[-1].meta.frames == frames
        assert len(_decoded(_mp4(chunks))["frames"]) == frames
    # No length at all: the stage's default (2 s at 4 fps: 8 -> 9).
    short = await _engine(tiny_video, default_seconds=2, default_fps=4, default_size="32x16")
    chunks = await _run(short, {"seed": 1})
    assert chunks[-1].meta == VideoMeta(format="mp4", width=32, height=16, frames=9, fps=4, seed=1)


async def test_the_same_seed_gives_the_same_bytes_on_any_replica(tiny_video: Path) -> None:
    # Replicas with the same thread count: the thread tuner may pick another count under
    # load, and another split of a matmul rounds differently (a flake in a loaded run).
    engine = await _engine(tiny_video, torch_threads=1)
    params = {"size": "32x32", "num_frames": 5, "seed": 1234}
    first = await _run(engine, params)
    again = await _run(engine, params)
    assert [c.data for c in first] == [c.data for c in again]
    other = await _run(engine, {**params, "seed": 99})
    assert _mp4(other) != _mp4(first) and other[0].data != first[0].data
    elsewhere = await _engine(tiny_video, torch_threads=1)
    assert _mp4(await _run(elsewhere, params)) == _mp4(first)
    # Without a seed the engine draws one and reports it: that seed makes it again.
    drawn = await _run(engine, {"size": "32x32", "num_frames": 5})
    assert drawn[-1].meta is not None and drawn[-1].meta.seed is not None
    assert _mp4(await _run(engine, {**params, "seed": drawn[-1].meta.seed})) == _mp4(drawn)


async def test_progress_is_counted_per_step_and_streamed_when_asked(tiny_video: Path) -> None:
    engine = await _engine(tiny_video)
    before = engine.progress
    chunks = await _run(engine, {"size": "32x32", "num_frames": 5, "seed": 2, "progress": True})
    steps = [c for c in chunks if not c.data]
    assert [c.meta for c in steps] == [ProgressMeta(step=s, steps=STEPS) for s in range(1, 4)]
    assert all(c.modality == "video" for c in steps) and chunks[-1].finished
    assert engine.progress - before == STEPS + 1  # each step, and the finished video
    assert len(await _run(engine, {"size": "32x32", "num_frames": 5})) == 2


async def test_abort_mid_generation_stops_it_and_frees_the_slot(tiny_video: Path) -> None:
    engine = await _engine(tiny_video)
    params = {"seed": 1, "num_inference_steps": 1000, "progress": True, "size": "64x64"}
    request = _request({**params, "num_frames": 17})
    first_step = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(request):
            first_step.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first_step.wait(), 30)
    waiting = asyncio.create_task(_run(engine, {"size": "32x32", "num_frames": 5}))
    await asyncio.sleep(0.2)
    assert engine.queue_length == 1  # one video at a time: the second one waits
    task.cancel()
    started = time.monotonic()
    done = await asyncio.wait_for(waiting, 30)
    assert done[-1].finished and _decoded(_mp4(done))["size"] == (32, 32)
    assert time.monotonic() - started < 10
    assert engine.progress < 1000  # the long one stopped well before its last step
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"size": "40x32"}, "size"),  # not a multiple of Wan's 16
        ({"size": "33x32"}, "size"),
        ({"size": "1024x1024"}, "size"),
        ({"num_frames": 50}, "num_frames"),
        ({"seconds": 10, "fps": 8}, "seconds"),
        ({"fps": 0}, "fps"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
    ],
)
async def test_bad_params_are_refused_naming_the_field(
    tiny_video: Path, params: dict[str, Any], param: str
) -> None:
    limits = {"max_generated_video_size": 256 * 256, "max_frames": 41, "default_seconds": 2}
    engine = await _engine(tiny_video, **limits)
    with pytest.raises(BadRequestError) as err:
        engine.check(P.video(params))
    assert err.value.param == param
    with pytest.raises(BadRequestError) as err:
        await _run(engine, params)
    assert err.value.param == param


async def test_a_text_only_pipeline_refuses_a_first_frame(tiny_video: Path) -> None:
    engine = await _engine(tiny_video)
    with pytest.raises(BadRequestError, match="text only") as err:
        await _run(engine, {"size": "32x32"}, images=[_png((255, 0, 0))])
    assert err.value.param == "input_reference"
    assert engine.progress == 0 and engine.queue_length == 0


async def test_an_image_to_video_pipeline_animates_the_given_first_frame(tiny_i2v: Path) -> None:
    engine = await _engine(tiny_i2v, warmup=True)
    assert engine.info is not None and engine.info.needs_image
    params = {"size": "32x32", "num_frames": 5, "seed": 3}
    red = await _run(engine, params, images=[_png((255, 0, 0))])
    assert len(_decoded(_mp4(red))["frames"]) == 5
    assert _mp4(await _run(engine, params, images=[_png((255, 0, 0))])) == _mp4(red)
    assert _mp4(await _run(engine, params, images=[_png((0, 0, 255))])) != _mp4(red)
    for images, why in ((None, "animates an image"), ([b"not an image"], "not an image")):
        with pytest.raises(BadRequestError, match=why) as err:
            await _run(engine, params, images=images)
        assert err.value.param == "input_reference"


async def test_start_fails_clearly_without_a_usable_model(tmp_path: Path, tiny_video: Path) -> None:
    with pytest.raises(EngineError, match=r"\(engine video\) needs engine_args\.model"):
        await VideoEngine(_stage(None)).start()
    with pytest.raises(EngineError, match="is not a directory"):
        await VideoEngine(_stage(tmp_path / "missing")).start()
    with pytest.raises(EngineError, match="could not load the diffusers pipeline"):
        await VideoEngine(_stage(tmp_path)).start()
    with pytest.raises(EngineError, match="needs sides that are multiples of 16"):
        await VideoEngine(_stage(tiny_video, default_size="40x32")).start()


# -- through a head: a PipelineRequest, and `omnistage serve video` -------------------------


def _overrides(model: Path) -> dict[str, Any]:
    return {"0": {"engine_args": {"model": str(model), "num_inference_steps": STEPS}}}


def test_a_pipeline_request_gets_progress_a_thumbnail_and_the_mp4(tiny_video: Path) -> None:
    async def scenario() -> list[Any]:
        async with running_head(load_config("video", _overrides(tiny_video))) as head:
            params = P.video(size="32x32", seconds=1, fps=4, seed=5, progress=True)
            stream = await head.service.open(
                PipelineRequest("v1", Prompt(text="a cat"), [0], params)
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(scenario())
    assert [c.meta.step for c in chunks[:STEPS]] == [1, 2, 3]
    thumb, video = chunks[STEPS:]
    assert thumb.meta.format == "png" and not thumb.finished
    assert video.finished and video.error is None and video.usage.prompt_tokens > 0
    assert video.meta == VideoMeta(format="mp4", width=32, height=32, frames=5, fps=4, seed=5)
    seen = _decoded(video.data)
    assert (seen["size"], len(seen["frames"]), seen["rate"]) == ((32, 32), 5, Fraction(4))


def test_serve_video_loads_a_replica_of_the_given_model(tmp_path: Path, tiny_video: Path) -> None:
    overrides = json.dumps(_overrides(tiny_video))
    head = HeadProc(tmp_path, "video", "--stage-overrides", overrides, name="video-head")
    try:
        head.wait_healthy(timeout=120)
        (stage,) = head.stages()["stages"]
        assert (stage["name"], stage["engine"], stage["output_modality"]) == (
            "video",
            "video",
            "video",
        )
        assert [r["state"] for r in stage["replicas"]] == ["UP"]
        assert "video" in head.client.get("/v1/models").json()["data"][0]["id"]
    finally:
        head.stop()

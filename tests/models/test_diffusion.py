"""The diffusion engine on a tiny random-weight Stable Diffusion pipeline, in-process and
behind a real head serving the painter pipeline (SmolLM2 thinker -> tiny painter)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest, stage_input
from omnistage.engines.image.diffusion import DiffusionEngine
from omnistage.protocol.chunk_meta import ImageMeta, ProgressMeta
from omnistage.protocol.errors import BadRequestError, EngineError
from omnistage.protocol.messages import Prompt
from tests import params as P
from tests.diffusion_tiny import build_tiny_pipeline
from tests.integration.harness import HeadProc, free_port

pytestmark = pytest.mark.slow

PIL = pytest.importorskip("PIL.Image")
STEPS = 4


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_pipeline(tmp_path_factory.mktemp("diffusers") / "tiny-sd")


def _stage(model: Path | None, **engine_args: Any) -> StageConfig:
    args: dict[str, Any] = {"num_inference_steps": STEPS, "warmup": False, **engine_args}
    if model is not None:
        args["model"] = str(model)
    return StageConfig(
        stage_id=1,
        name="painter",
        engine="diffusion",
        output_modality="image",
        final_output=True,
        engine_args=args,
    )


async def _engine(model: Path, **engine_args: Any) -> DiffusionEngine:
    engine = DiffusionEngine(_stage(model, **engine_args))
    await engine.start()
    return engine


async def _nothing() -> AsyncIterator[Any]:
    return
    yield


async def _run(
    engine: DiffusionEngine, params: dict[str, Any], prompt: str = "a red cat"
) -> list[EngineChunk]:
    request = EngineRequest("req-1", Prompt(text=prompt), P.image(params), _nothing())
    return [chunk async for chunk in engine.generate(request)]


def _images(chunks: list[EngineChunk]) -> list[bytes]:
    return [c.data for c in chunks if c.data]


def _decoded(data: bytes) -> Any:
    image = PIL.open(io.BytesIO(data))
    image.load()
    return image


# -- the engine, in-process ------------------------------------------------------------


async def test_n_images_of_the_asked_size_one_chunk_each_the_last_finished(
    tiny_model: Path,
) -> None:
    engine = await _engine(tiny_model)
    chunks = await _run(engine, {"n": 3, "size": "128x64", "seed": 40})
    assert [c.modality for c in chunks] == ["image"] * 3
    assert [c.finished for c in chunks] == [False, False, True]
    assert [c.meta for c in chunks] == [
        ImageMeta(format="png", width=128, height=64, seed=40 + i, index=i) for i in range(3)
    ]
    for chunk in chunks:
        image = _decoded(chunk.data)
        assert (image.format, image.size) == ("PNG", (128, 64))
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    # auto: the model's native size (its UNet's 8x8 latents, times the VAE's 8).
    [auto] = _images(await _run(engine, {"seed": 1}))
    assert _decoded(auto).size == (64, 64)


async def test_the_same_seed_gives_the_same_bytes_and_image_i_uses_seed_plus_i(
    tiny_model: Path,
) -> None:
    engine = await _engine(tiny_model)
    first = _images(await _run(engine, {"n": 2, "seed": 1234}))
    again = _images(await _run(engine, {"n": 2, "seed": 1234}))
    other = _images(await _run(engine, {"n": 1, "seed": 99}))
    assert first == again
    assert first[0] != first[1] and other[0] not in first
    assert _images(await _run(engine, {"seed": 1235})) == first[1:]
    # A fresh engine (another replica) draws the very same image.
    elsewhere = await _engine(tiny_model)
    assert _images(await _run(elsewhere, {"n": 2, "seed": 1234})) == first


async def test_jpeg_and_webp_decode(tiny_model: Path) -> None:
    engine = await _engine(tiny_model)
    for fmt, pil_name in (("jpeg", "JPEG"), ("webp", "WEBP")):
        chunks = await _run(engine, {"seed": 3, "output_format": fmt, "size": "64x128"})
        image = _decoded(chunks[-1].data)
        assert (image.format, image.size) == (pil_name, (64, 128))
        assert chunks[-1].meta is not None and chunks[-1].meta.format == fmt


async def test_a_painter_draws_all_of_its_upstream_text(tiny_model: Path) -> None:
    engine = await _engine(tiny_model)

    async def upstream() -> AsyncIterator[Any]:
        for piece in ("a red", " cat"):
            yield stage_input(0, piece)

    request = EngineRequest("req-2", None, P.image(seed=8), upstream())
    drawn = _images([c async for c in engine.generate(request)])
    assert drawn == _images(await _run(engine, {"seed": 8}, prompt="a red cat"))
    assert drawn != _images(await _run(engine, {"seed": 8}, prompt="a red"))


async def test_progress_is_counted_per_step_and_streamed_when_asked(tiny_model: Path) -> None:
    engine = await _engine(tiny_model)
    before = engine.progress
    chunks = await _run(engine, {"seed": 5, "n": 2, "progress": True})
    steps = [c.meta for c in chunks if not c.data]
    assert steps == [
        ProgressMeta(step=s, steps=STEPS, index=i) for i in range(2) for s in range(1, 5)
    ]
    assert engine.progress - before == 2 * (STEPS + 1)  # each step, and each finished image
    quiet = await _run(engine, {"seed": 5})
    assert all(c.data for c in quiet)


async def test_abort_mid_generation_stops_it_and_frees_the_slot(tiny_model: Path) -> None:
    engine = await _engine(tiny_model)
    params = {"seed": 1, "num_inference_steps": 400, "progress": True, "size": "128x128"}
    request = EngineRequest("long", Prompt(text="a cat"), P.image(params), _nothing())
    first_step = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(request):
            first_step.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first_step.wait(), 30)
    assert engine.queue_length == 0
    waiting = asyncio.create_task(_run(engine, {"seed": 2}))
    await asyncio.sleep(0.2)
    assert engine.queue_length == 1  # one generation at a time: the second one waits
    task.cancel()
    started = time.monotonic()
    done = await asyncio.wait_for(waiting, 30)
    assert len(_images(done)) == 1
    assert time.monotonic() - started < 10
    assert engine.progress < 400  # the long one stopped well before its last step
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_two_slots_draw_at_once_and_the_same_as_one(tiny_model: Path) -> None:
    one = await _engine(tiny_model)
    two = await _engine(tiny_model, max_concurrent=2)
    together = await asyncio.gather(*(_run(two, {"seed": s, "n": 2}) for s in (10, 20)))
    apart = [await _run(one, {"seed": s, "n": 2}) for s in (10, 20)]
    assert [_images(c) for c in together] == [_images(c) for c in apart]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"size": "100x64"}, "size"),
        ({"size": "2048x2048"}, "size"),
        ({"n": 11}, "n"),
        ({"output_format": "gif"}, "output_format"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
    ],
)
async def test_bad_params_are_refused_naming_the_field(
    tiny_model: Path, params: dict[str, Any], param: str
) -> None:
    engine = await _engine(tiny_model, max_generated_image_size=256 * 256)
    with pytest.raises(BadRequestError) as err:
        engine.check(P.image(params))
    assert err.value.param == param
    with pytest.raises(BadRequestError) as err:
        await _run(engine, params)
    assert err.value.param == param


async def test_start_fails_clearly_without_a_usable_model(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"needs engine_args\.model.*--stage-overrides"):
        await DiffusionEngine(_stage(None)).start()
    with pytest.raises(EngineError, match="is not a directory"):
        await DiffusionEngine(_stage(tmp_path / "missing")).start()
    with pytest.raises(EngineError, match="could not load the diffusers pipeline"):
        await DiffusionEngine(_stage(tmp_path)).start()


async def test_start_refuses_a_class_that_is_not_a_pipeline(tiny_model: Path) -> None:
    with pytest.raises(EngineError, match="'AutoencoderKL' is not a diffusers pipeline class"):
        await DiffusionEngine(_stage(tiny_model, model_class_name="AutoencoderKL")).start()
    named = await _engine(tiny_model, model_class_name="StableDiffusionPipeline", warmup=True)
    assert named.info is not None and named.info.class_name == "StableDiffusionPipeline"


async def test_memory_flags_start_on_the_cpu_and_still_draw(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    flags = {"vae_use_slicing": True, "vae_use_tiling": True, "enable_cpu_offload": True}
    engine = await _engine(tiny_model, device="cpu", **flags)
    assert "enable_cpu_offload has no effect without a GPU" in caplog.text
    [image] = _images(await _run(engine, {"seed": 1, "size": "128x128"}))
    assert _decoded(image).size == (128, 128)


# -- over HTTP: the painter pipeline -----------------------------------------------------

MAX_PIXELS = 128 * 128


@pytest.fixture(scope="module")
def painter_head(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[HeadProc]:
    overrides = {
        "0": {"default_sampling_params": {"max_tokens": 24}},
        "1": {"engine_args": {"model": str(tiny_model), "num_inference_steps": STEPS}},
    }
    head = HeadProc(
        tmp_path_factory.mktemp("painter"),
        "painter",
        "--stage-overrides",
        json.dumps(overrides),
        "--max-generated-image-size",
        str(MAX_PIXELS),
        name="painter-head",
    )
    try:
        head.wait_healthy(timeout=100)
        yield head
    finally:
        head.stop()


def _client(head: HeadProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{head.url}/v1", api_key="x", max_retries=0, timeout=60)


GREEDY = {"stage_params": {"thinker": {"temperature": 0}}}


def test_openai_client_gets_n_pngs_and_the_thinkers_expansion(painter_head: HeadProc) -> None:
    client = _client(painter_head)
    prompt = "a lighthouse at night"
    out = client.images.generate(
        model="painter", prompt=prompt, n=2, size="128x64", extra_body={"seed": 11, **GREEDY}
    )
    assert out.size == "128x64" and out.output_format == "png"
    assert out.data is not None and len(out.data) == 2
    for item in out.data:
        image = _decoded(base64.b64decode(item.b64_json or ""))
        assert (image.format, image.size) == ("PNG", (128, 64))
    revised = out.data[0].revised_prompt
    assert revised and revised != prompt and out.data[1].revised_prompt == revised
    # The revised prompt is exactly what the thinker writes for that prompt (it is also a
    # final text stage, so a chat completion returns its expansion on its own).
    chat = client.chat.completions.create(
        model="painter", messages=[{"role": "user", "content": prompt}], temperature=0
    )
    assert chat.choices[0].message.content.strip() == revised
    assert out.usage is not None and out.usage.output_tokens > 0
    again = client.images.generate(
        prompt=prompt, n=2, size="128x64", extra_body={"seed": 11, **GREEDY}
    )
    assert again.data is not None
    assert [d.b64_json for d in again.data] == [d.b64_json for d in out.data]


def test_revise_prompt_false_draws_the_prompt_as_given(painter_head: HeadProc) -> None:
    client = _client(painter_head)
    body = {"seed": 3, "revise_prompt": False}
    first = client.images.generate(prompt="a red cat", size="64x64", extra_body=body)
    again = client.images.generate(prompt="a red cat", size="64x64", extra_body=body)
    other = client.images.generate(prompt="a red cat", size="64x64", extra_body={**body, "seed": 4})
    assert first.data and again.data and other.data
    assert first.data[0].revised_prompt is None
    assert first.data[0].b64_json == again.data[0].b64_json != other.data[0].b64_json


def test_url_and_oversized_requests_are_400s_naming_the_field(painter_head: HeadProc) -> None:
    client = _client(painter_head)
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="a cat", response_format="url")
    assert err.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="a cat", size="1024x1024")
    assert err.value.body["param"] == "size"  # type: ignore[index]
    assert f"at most {MAX_PIXELS}" in err.value.body["message"]  # type: ignore[index]
    response = painter_head.client.post(
        "/v1/images/generations", json={"prompt": "a cat", "stage": "thinker"}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "stage"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "a cat", "size": "0x0", "revise_prompt": False}, 400, "size"),
        ({"prompt": "a cat", "size": "99999x99999", "revise_prompt": False}, 400, "size"),
        ({"prompt": "a cat", "size": "autox", "revise_prompt": False}, 400, "size"),
        ({"prompt": "a cat", "seed": 2**70}, 400, "seed"),
        ({"prompt": "a cat", "n": 10**9}, 400, "n"),
        ({"prompt": "a cat", "guidance_scale": "NaN"}, 400, "guidance_scale"),
        ({"prompt": ["a", "cat"]}, 400, "prompt"),
        ({"prompt": "a cat", "stage_params": {"\u00b3": {}}}, 400, "stage_params"),
        ({"prompt": "a cat", "stage_params": {"thinker": {"max_tokens": 0}}}, 400, "max_tokens"),
        ({"prompt": "a cat", "model": "dall-e-3"}, 404, "model"),
    ],
)
def test_hostile_bodies_are_4xx_naming_the_field(
    painter_head: HeadProc, body: dict[str, Any], status: int, param: str
) -> None:
    response = painter_head.client.post("/v1/images/generations", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_a_stream_sends_step_progress_then_each_image(painter_head: HeadProc) -> None:
    body = {"prompt": "a red cat", "stream": True, "n": 2, "size": "64x64", "seed": 1}
    events = []
    with painter_head.client.stream("POST", "/v1/images/generations", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    kinds = [e["type"] for e in events]
    assert kinds == (["image_generation.progress"] * STEPS + ["image_generation.completed"]) * 2
    assert [e["step"] for e in events[:STEPS]] == list(range(1, STEPS + 1))
    done = [e for e in events if e["type"] == "image_generation.completed"]
    assert [e["image_index"] for e in done] == [0, 1] and done[0]["revised_prompt"]
    assert _decoded(base64.b64decode(done[1]["b64_json"])).size == (64, 64)


def test_without_a_model_the_painter_pipeline_fails_before_starting(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "omnistage", "serve", "painter", "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "stage 1 'painter' (engine diffusion) needs engine_args.model" in proc.stderr
    assert "omnistage serve painter --stage-overrides" in proc.stderr
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)


def test_a_pipeline_without_an_image_stage_answers_404(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo", name="echo-head")
    try:
        head.wait_healthy()
        response = head.client.post("/v1/images/generations", json={"prompt": "a cat"})
        assert response.status_code == 404
        assert "has no image stage" in response.json()["error"]["message"]
    finally:
        head.stop()


async def test_each_slot_draws_on_its_own_thread_the_first_on_the_loading_one(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from omnistage.engines.image import diffusers_pipe as dp

    threads: dict[str, int] = {}
    real_load, real_draw = dp.load, dp.draw

    def load(*args: Any) -> Any:
        threads["load"] = threading.get_ident()
        return real_load(*args)

    def draw(*args: Any) -> Any:
        threads.setdefault("draw", threading.get_ident())
        return real_draw(*args)

    monkeypatch.setattr(dp, "load", load)
    monkeypatch.setattr(dp, "draw", draw)
    engine = await _engine(tiny_model, max_concurrent=2)
    try:
        first = engine._free[-1]  # the slot a generation takes first
        assert _images(await _run(engine, {"size": "64x64"}))
        # One OpenMP pool per thread: slots on their own threads, not asyncio's pool.
        assert threads["draw"] == first.thread.ident != threading.get_ident()
        assert threads["load"] == engine._free[0].thread.ident
        assert engine._free[0].thread.ident != engine._free[1].thread.ident
        # No torch_threads: each slot tunes its own count.
        assert all(s.tuner is not None for s in engine._free)
    finally:
        await engine.shutdown()
    fixed = await _engine(tiny_model, torch_threads=1)
    try:
        assert all(s.tuner is None for s in fixed._free)
    finally:
        await fixed.shutdown()

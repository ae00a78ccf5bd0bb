"""POST /v1/images/edits on the tiny random-weight Stable Diffusion pipeline: through the
official openai SDK against a real head serving one diffusion stage, and the engine's
edit variants in-process (they share the loaded pipeline's modules)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest
from omnistage.engines.image.diffusion import DiffusionEngine
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import Prompt
from tests import params as P
from tests.diffusion_tiny import build_tiny_pipeline
from tests.integration.harness import HeadProc

pytestmark = pytest.mark.slow

Image = pytest.importorskip("PIL.Image")
STEPS = 4
MAX_PIXELS = 128 * 128
SOURCE_SIZE = (96, 64)
HOLE = (32, 16, 64, 48)  # left, top, right, bottom: the mask's transparent square


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_pipeline(tmp_path_factory.mktemp("diffusers") / "tiny-sd")


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _source(size: tuple[int, int] = SOURCE_SIZE) -> Any:
    """A smooth gradient: a picture the random model's noise looks nothing like."""
    width, height = size
    image = Image.new("RGB", size)
    pixels = [
        (x * 255 // width, y * 255 // height, 90) for y in range(height) for x in range(width)
    ]
    image.putdata(pixels)
    return image


def _mask(size: tuple[int, int] = SOURCE_SIZE, hole: tuple[int, ...] = HOLE) -> Any:
    """OpenAI's mask: opaque, with a fully transparent square where to edit."""
    mask = Image.new("RGBA", size, (255, 255, 255, 255))
    mask.paste((0, 0, 0, 0), hole)
    return mask


SOURCE_PNG, MASK_PNG = _png(_source()), _png(_mask())


def _decoded(b64: str | None) -> Any:
    image = Image.open(io.BytesIO(base64.b64decode(b64 or "")))
    image.load()
    return image


def _inside(box: tuple[int, ...], x: int, y: int) -> bool:
    return box[0] <= x < box[2] and box[1] <= y < box[3]


def _mean_diff(a: Any, b: Any, keep: Any) -> float:
    """Mean absolute RGB difference over the pixels (x, y) where ``keep(x, y)``."""
    width, height = a.size
    total, count = 0, 0
    pa, pb = a.convert("RGB").load(), b.convert("RGB").load()
    for y in range(height):
        for x in range(width):
            if keep(x, y):
                total += sum(abs(p - q) for p, q in zip(pa[x, y], pb[x, y], strict=True))
                count += 3
    return total / count


# -- over HTTP, with the openai SDK ------------------------------------------------------


@pytest.fixture(scope="module")
def edits_head(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[HeadProc]:
    tmp = tmp_path_factory.mktemp("edits")
    stage = {
        "stage_id": 0,
        "name": "painter",
        "engine": "diffusion",
        "final_output": True,
        "output_modality": "image",
        "engine_args": {
            "model": str(tiny_model),
            "num_inference_steps": STEPS,
            "max_generated_image_size": MAX_PIXELS,
            "warmup": False,
        },
    }
    config = tmp / "edits.yaml"
    config.write_text(json.dumps({"pipeline": "edits", "stages": [stage]}))  # JSON is YAML
    head = HeadProc(tmp, str(config), name="edits-head")
    try:
        head.wait_healthy(timeout=100)
        yield head
    finally:
        head.stop()


@pytest.fixture(scope="module")
def client(edits_head: HeadProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edits_head.url}/v1", api_key="x", max_retries=0, timeout=60)


def _edit(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("image", ("source.png", SOURCE_PNG, "image/png"))
    kwargs.setdefault("prompt", "a red hat")
    extra = {k: kwargs.pop(k) for k in ("seed", "strength", "num_inference_steps") if k in kwargs}
    return client.images.edit(extra_body=extra, **kwargs)


def test_image_to_image_returns_pngs_of_the_asked_size(client: openai.OpenAI) -> None:
    out = _edit(client, size="64x64", n=2, seed=5, strength=0.75)
    assert out.size == "64x64" and out.output_format == "png"
    assert out.data is not None and len(out.data) == 2
    images = [_decoded(item.b64_json) for item in out.data]
    assert [(i.format, i.size) for i in images] == [("PNG", (64, 64))] * 2
    assert out.data[0].b64_json != out.data[1].b64_json  # seeds 5 and 6
    # auto: the source image's size (within the stage's limit).
    auto = _edit(client, seed=5)
    assert auto.size == "96x64" and _decoded(auto.data[0].b64_json).size == SOURCE_SIZE


def test_the_same_seed_gives_the_same_bytes_and_the_source_shows_through(
    client: openai.OpenAI,
) -> None:
    first = _edit(client, seed=21, strength=0.5).data[0].b64_json
    assert _edit(client, seed=21, strength=0.5).data[0].b64_json == first
    assert _edit(client, seed=22, strength=0.5).data[0].b64_json != first
    # The source shapes the result: another source, same seed, another image.
    other = ("other.png", _png(_source().rotate(180)), "image/png")
    assert _edit(client, image=other, seed=21, strength=0.5).data[0].b64_json != first
    # A random model turns any source into noise, but a weaker strength leaves less.
    source = _source()
    weak = _decoded(_edit(client, seed=21, strength=0.25, num_inference_steps=8).data[0].b64_json)
    strong = _decoded(_edit(client, seed=21, strength=1.0, num_inference_steps=8).data[0].b64_json)
    everywhere = lambda x, y: True  # noqa: E731
    assert _mean_diff(weak, source, everywhere) < _mean_diff(strong, source, everywhere)


def test_a_mask_inpaints_only_its_transparent_square(client: openai.OpenAI) -> None:
    mask = ("mask.png", MASK_PNG, "image/png")
    out = _edit(client, mask=mask, seed=3)
    image = _decoded(out.data[0].b64_json)
    assert (image.format, image.size, out.size) == ("PNG", SOURCE_SIZE, "96x64")
    source = _source()
    outside = lambda x, y: not _inside(HOLE, x, y)  # noqa: E731
    inside = lambda x, y: _inside(HOLE, x, y)  # noqa: E731
    # Outside the square every pixel is the source's (the random VAE alone would change
    # them all: the engine pastes the source back there); inside, the drawing.
    assert _mean_diff(image, source, outside) == 0
    assert _mean_diff(image, source, inside) > 20
    again = _decoded(_edit(client, mask=mask, seed=3).data[0].b64_json)
    other = _decoded(_edit(client, mask=mask, seed=4).data[0].b64_json)
    assert _png(again) == _png(image) and _mean_diff(other, image, inside) > 0
    # At another size, the source and its mask are resized alike.
    small = _decoded(_edit(client, mask=mask, seed=3, size="64x64").data[0].b64_json)
    assert small.size == (64, 64)


def _refused(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    return err.value.body  # type: ignore[return-value]


def test_bad_uploads_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    not_png = ("source.png", b"\x89PNG but not really", "image/png")
    body = _refused(lambda: _edit(client, image=not_png))
    assert body["param"] == "image" and "not a PNG, JPEG or WebP" in body["message"]
    wrong = ("mask.png", _png(_mask((64, 64), (0, 0, 8, 8))), "image/png")
    body = _refused(lambda: _edit(client, mask=wrong))
    assert body["param"] == "mask" and "must be the same size" in body["message"]
    opaque = ("mask.png", _png(_source()), "image/png")
    assert _refused(lambda: _edit(client, mask=opaque))["param"] == "mask"
    body = _refused(lambda: _edit(client, response_format="url"))
    assert body["param"] == "response_format" and "url" in body["message"]
    two = [("a.png", SOURCE_PNG, "image/png"), ("b.png", SOURCE_PNG, "image/png")]
    body = _refused(lambda: _edit(client, image=two))
    assert body["param"] == "image" and "one image per request" in body["message"]
    assert _refused(lambda: _edit(client, size="1024x1024"))["param"] == "size"
    # strength 0.1 of 4 steps leaves none to run.
    assert _refused(lambda: _edit(client, seed=1, strength=0.1))["param"] == "strength"
    assert _refused(lambda: _edit(client, seed=1, strength=1.5))["param"] == "strength"


@pytest.mark.parametrize(
    ("files", "data", "param"),
    [
        ([], {"prompt": "a hat"}, "image"),
        ([("image", ("a.png", SOURCE_PNG, "image/png"))], {}, "prompt"),
        ([("image", ("a.png", b"", "image/png"))], {"prompt": "a hat"}, "image"),
        ([("image", ("a.png", SOURCE_PNG, "image/png"))], {"prompt": "x", "n": "0"}, "n"),
        ([("image", ("a.png", SOURCE_PNG, "image/png"))], {"prompt": "x", "seed": "-1"}, "seed"),
        (
            [("image", ("a.png", SOURCE_PNG, "image/png"))],
            {"prompt": "x", "stage_params[painter][seed]": "1"},
            "stage_params",
        ),
        ([("image", ("a.png", SOURCE_PNG, "image/png"))], {"prompt": "x", "stage": "9"}, "stage"),
    ],
)
def test_hostile_forms_are_400s_naming_the_field(
    edits_head: HeadProc, files: list[Any], data: dict[str, str], param: str
) -> None:
    # No files: httpx sends the fields alone, url-encoded (a form too).
    response = edits_head.client.post("/v1/images/edits", files=files or None, data=data)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_uploads_larger_than_json_bodies_pass_the_body_limit_up_to_their_own(
    edits_head: HeadProc,
) -> None:
    # 20 MB is over the default 16 MiB body limit, under the 50 MB an image may be: the
    # route reads it (and finds it is not an image).
    junk = [("image", ("big.png", b"\0" * (20 * 1024 * 1024), "image/png"))]
    response = edits_head.client.post("/v1/images/edits", files=junk, data={"prompt": "x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "image"
    mask = ("mask.png", b"\0" * (4 * 1024 * 1024 + 1), "image/png")
    files = [("image", ("a.png", SOURCE_PNG, "image/png")), ("mask", mask)]
    response = edits_head.client.post("/v1/images/edits", files=files, data={"prompt": "x"})
    assert response.status_code == 413 and response.json()["error"]["param"] == "mask"


def test_a_stream_sends_the_steps_an_edit_runs_then_the_image(edits_head: HeadProc) -> None:
    files = [("image", ("a.png", SOURCE_PNG, "image/png"))]
    data = {"prompt": "a red hat", "stream": "true", "seed": "2", "strength": "0.5"}
    events = []
    with edits_head.client.stream("POST", "/v1/images/edits", files=files, data=data) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    # strength 0.5 of 4 steps: the last 2 of the schedule run.
    kinds = [e["type"] for e in events]
    assert kinds == ["image_edit.progress"] * 2 + ["image_edit.completed"]
    assert [(e["step"], e["steps"]) for e in events[:2]] == [(1, 2), (2, 2)]
    done = events[-1]
    assert done["size"] == "96x64" and done["seed"] == 2
    assert _decoded(done["b64_json"]).size == SOURCE_SIZE


# -- the engine, in-process --------------------------------------------------------------


def _stage(model: Path, **engine_args: Any) -> StageConfig:
    args = {"model": str(model), "num_inference_steps": STEPS, "warmup": False, **engine_args}
    return StageConfig(
        stage_id=0,
        name="painter",
        engine="diffusion",
        output_modality="image",
        final_output=True,
        engine_args=args,
    )


async def _nothing() -> AsyncIterator[Any]:
    return
    yield


async def _run(engine: DiffusionEngine, prompt: Prompt, **params: Any) -> list[EngineChunk]:
    request = EngineRequest("edit-1", prompt, P.image(params), _nothing())
    return [chunk async for chunk in engine.generate(request)]


async def test_edit_variants_share_the_loaded_weights_and_are_built_once(
    tiny_model: Path,
) -> None:
    engine = DiffusionEngine(_stage(tiny_model))
    await engine.start()
    try:
        [slot] = engine._free
        edit = Prompt(text="a hat", images=[SOURCE_PNG])
        inpaint = Prompt(text="a hat", images=[SOURCE_PNG], mask=MASK_PNG)
        assert (await _run(engine, edit, seed=1))[-1].data
        assert (await _run(engine, inpaint, seed=1))[-1].data
        built = {kind: pipe for kind, (pipe, _) in slot.variants.items()}
        assert set(built) == {"image-to-image", "inpainting"}
        for kind, pipe in built.items():
            assert (
                type(pipe).__name__
                == {
                    "image-to-image": "StableDiffusionImg2ImgPipeline",
                    "inpainting": "StableDiffusionInpaintPipeline",
                }[kind]
            )
            for name in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
                assert getattr(pipe, name) is getattr(slot.pipe, name), (kind, name)
        await _run(engine, edit, seed=2)
        assert slot.variants["image-to-image"][0] is built["image-to-image"]
        # Text to image still draws on the loaded pipeline.
        assert (await _run(engine, Prompt(text="a hat"), seed=1))[-1].data
    finally:
        await engine.shutdown()


async def test_a_pipeline_without_edit_variants_refuses_naming_image_or_mask(
    tiny_model: Path,
) -> None:
    # The same weights as a panorama pipeline, for which diffusers has no edit variant.
    engine = DiffusionEngine(_stage(tiny_model, model_class_name="StableDiffusionPanoramaPipeline"))
    await engine.start()
    try:
        with pytest.raises(BadRequestError) as err:
            await _run(engine, Prompt(text="a hat", images=[SOURCE_PNG]), seed=1)
        assert err.value.param == "image"
        assert "StableDiffusionPanoramaPipeline" in str(err.value)
        assert "no image-to-image variant" in str(err.value)
        with pytest.raises(BadRequestError) as err:
            await _run(engine, Prompt(text="a hat", images=[SOURCE_PNG], mask=MASK_PNG), seed=1)
        assert err.value.param == "mask" and "no inpainting variant" in str(err.value)
        # The slot is free again: text to image still draws.
        drawn = await asyncio.wait_for(_run(engine, Prompt(text="a hat"), seed=1), 60)
        assert drawn[-1].data
    finally:
        await engine.shutdown()

"""An image request's params (engines/image_params.py) and bodies (ImageGenerationRequest,
ImageEditForm): what is accepted, and that every refusal names its field."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from omnistage.api.schemas.images import ImageEditForm, ImageGenerationRequest
from omnistage.config.engine_args import DiffusionArgs
from omnistage.config.load import validate_config
from omnistage.protocol.errors import BadRequestError, ConfigError
from omnistage.protocol.image_params import (
    DEFAULT_MAX_PIXELS,
    ImageJob,
    check_strength,
    fit_size,
    image_job,
    output_size,
    parse_size,
)
from omnistage.protocol.params import MAX_IMAGES, ImageParams, ParamKind, decode

MAX = 256 * 256


@pytest.mark.parametrize(
    ("value", "size"),
    [(None, None), ("auto", None), ("64x64", (64, 64)), ("256x128", (256, 128))],
)
def test_sizes_parse_to_width_and_height(value: str | None, size: tuple[int, int] | None) -> None:
    assert parse_size(value, MAX) == size


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("512", "WIDTHxHEIGHT"),
        ("64X64", "WIDTHxHEIGHT"),
        (" 64x64", "WIDTHxHEIGHT"),
        ("-64x64", "WIDTHxHEIGHT"),
        ("64x64x3", "WIDTHxHEIGHT"),
        (64, "WIDTHxHEIGHT"),
        ("100x64", "multiples of 8"),
        ("56x64", "at least 64"),
        ("512x512", "at most 65536"),
        ("99999x8", "multiples of 8"),
    ],
)
def test_bad_sizes_are_refused_naming_size(value: object, why: str) -> None:
    with pytest.raises(BadRequestError) as err:
        parse_size(value, MAX)
    assert err.value.param == "size"
    assert why in str(err.value)


def test_openai_sizes_pass_within_the_default_max() -> None:
    assert parse_size("1024x1024", DEFAULT_MAX_PIXELS) == (1024, 1024)
    with pytest.raises(BadRequestError, match="1572864 pixels"):
        parse_size("1536x1024", DEFAULT_MAX_PIXELS)


def test_fit_size_keeps_the_shape_within_the_max() -> None:
    assert fit_size(512, 512, DEFAULT_MAX_PIXELS) == (512, 512)
    assert fit_size(1024, 1024, 512 * 512) == (512, 512)
    width, height = fit_size(1344, 768, 512 * 512)
    assert width * height <= 512 * 512 and width % 8 == 0 and height % 8 == 0
    assert width > height


def _job(raw: dict, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageJob:
    """Params as the API decodes them, then as the engine reads them."""
    return image_job(decode(ParamKind.IMAGE, raw).imaging, max_pixels)


def test_an_empty_request_takes_every_default() -> None:
    job = _job({})
    assert (job.n, job.size, job.seed, job.output_format, job.progress) == (
        1,
        None,
        None,
        "png",
        False,
    )
    assert job.quality == 95


def test_a_full_request_is_read_as_given() -> None:
    job = _job(
        {
            "n": 3,
            "size": "128x64",
            "seed": 7,
            "num_inference_steps": 12,
            "guidance_scale": 5,
            "negative_prompt": "blurry",
            "output_format": "webp",
            "output_compression": 60,
            "progress": True,
        },
        MAX,
    )
    assert job.n == 3 and job.size == (128, 64) and job.seed == 7
    assert job.num_inference_steps == 12 and job.guidance_scale == 5.0
    assert job.negative_prompt == "blurry" and job.output_format == "webp"
    assert job.quality == 60 and job.progress


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": MAX_IMAGES + 1}, "n"),
        ({"n": True}, "n"),
        ({"n": 1.5}, "n"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"num_inference_steps": 1001}, "num_inference_steps"),
        ({"guidance_scale": -1}, "guidance_scale"),
        ({"guidance_scale": math.nan}, "guidance_scale"),
        ({"guidance_scale": math.inf}, "guidance_scale"),
        ({"guidance_scale": "7"}, "guidance_scale"),
        ({"guidance_scale": False}, "guidance_scale"),
        ({"negative_prompt": 3}, "negative_prompt"),
        ({"negative_prompt": "x" * 4001}, "negative_prompt"),
        ({"output_format": "gif"}, "output_format"),
        ({"output_compression": 101}, "output_compression"),
        ({"size": "7x7"}, "size"),
    ],
)
def test_bad_params_are_refused_naming_the_field(params: dict, param: str) -> None:
    with pytest.raises(BadRequestError) as err:
        _job(params, MAX)
    assert err.value.param == param


def test_request_body_takes_openai_fields_and_ignores_the_cosmetic_ones() -> None:
    body = ImageGenerationRequest.model_validate(
        {
            "prompt": "a cat",
            "model": "painter",
            "n": 2,
            "size": "1024x1024",
            "response_format": "b64_json",
            "quality": "hd",
            "style": "vivid",
            "user": "u1",
            "background": "auto",
            "seed": 5,
            "negative_prompt": "dogs",
        }
    )
    params = body.image_params(body.seed or 0)
    assert params == ImageParams(
        n=2, size="1024x1024", seed=5, output_format="png", progress=False, negative_prompt="dogs"
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a cat", "response_format": "url"}, "response_format"),
        ({"prompt": "   "}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x" * 32001}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "a cat", "n": 11}, "n"),
        ({"prompt": "a cat", "n": 0}, "n"),
        ({"prompt": "a cat", "output_format": "gif"}, "output_format"),
        ({"prompt": "a cat", "seed": -1}, "seed"),
        ({"prompt": "a cat", "seed": 2**64}, "seed"),
        ({"prompt": "a cat", "guidance_scale": 1000}, "guidance_scale"),
        ({"prompt": "a cat", "stage_params": {"0": {"x": 2**64}}}, "stage_params"),
    ],
)
def test_bad_bodies_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(ValidationError) as err:
        ImageGenerationRequest.model_validate(body)
    assert err.value.errors()[0]["loc"][0] == param


def test_diffusion_engine_args_are_checked_when_the_config_loads() -> None:
    def painter(**engine_args: object) -> dict:
        stage = {"stage_id": 0, "name": "painter", "engine": "diffusion", "final_output": True}
        return {"pipeline": "p", "stages": [{**stage, "engine_args": engine_args}]}

    assert validate_config(painter()).stages[0].engine_args == {}
    cases = [
        ({"max_generated_image_size": 100}, "engine_args.max_generated_image_size"),
        ({"default_size": "100x64"}, "engine_args.default_size"),
        ({"max_generated_image_size": 65536, "default_size": "512x512"}, "default_size"),
        ({"model_class_name": "not a class"}, "engine_args.model_class_name"),
        ({"vae_slicing": True}, "engine_args.vae_slicing"),
        ({"max_concurrent": 0}, "engine_args.max_concurrent"),
    ]
    for args, where in cases:
        with pytest.raises(ConfigError, match=where):
            validate_config(painter(**args))
    assert DiffusionArgs().max_concurrent == 1


def test_a_long_thin_shape_still_fits_within_the_max() -> None:
    width, height = fit_size(4000, 20, 128 * 128)
    assert height == 64 and width * height <= 128 * 128 and width % 8 == 0
    width, height = fit_size(20, 4000, 128 * 128)
    assert width == 64 and width * height <= 128 * 128 and height % 8 == 0


def test_an_edit_draws_at_the_asked_size_else_at_its_source_images_shape() -> None:
    default = (512, 512)
    assert output_size((128, 64), (640, 480), default, MAX) == (128, 64)
    assert output_size(None, None, default, MAX) == default
    # auto: the source's shape, within the stage's limit, sides multiples of 8.
    assert output_size(None, (96, 64), default, MAX) == (96, 64)
    assert output_size(None, (100, 70), default, MAX) == (96, 64)
    width, height = output_size(None, (1600, 1200), default, MAX)
    assert width * height <= MAX and (width, height) == (288, 216)


def test_strength_must_leave_at_least_one_denoising_step() -> None:
    check_strength(4, None)
    check_strength(4, 0.25)
    check_strength(1, 1.0)
    for steps, strength in ((4, 0.2), (10, 0.0), (1, 0.99)):
        with pytest.raises(BadRequestError, match="no denoising step") as err:
            check_strength(steps, strength)
        assert err.value.param == "strength"


def test_strength_is_read_and_bounded() -> None:
    assert _job({"strength": 0.6}).strength == 0.6
    assert _job({}).strength is None
    for bad in (-0.1, 1.5, "0.5"):
        with pytest.raises(BadRequestError) as err:
            _job({"strength": bad})
        assert err.value.param == "strength"


def test_an_edit_form_reads_text_values_and_gives_strength_to_the_stage() -> None:
    form = ImageEditForm.model_validate(
        {"prompt": "a hat", "n": "2", "size": "64x64", "strength": "0.5", "stream": "true"}
    )
    params = form.image_params(9)
    assert (params.n, params.size, params.seed, params.strength) == (2, "64x64", 9, 0.5)
    assert params.progress is True
    for body, param in (
        ({"prompt": "a hat", "strength": "2"}, "strength"),
        ({"prompt": "a hat", "response_format": "url"}, "response_format"),
        ({"prompt": ""}, "prompt"),
    ):
        with pytest.raises(ValidationError) as err:
            ImageEditForm.model_validate(body)
        assert err.value.errors()[0]["loc"][0] == param

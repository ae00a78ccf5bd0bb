"""A video request's params (protocol VideoParams, engines/video_params.py), the video
engine's args and the built-in video pipeline: what is accepted, which frame counts a
pipeline makes, and that every refusal names its field."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from omnistage.cli.args import UsageError
from omnistage.cli.engine_flags import check_diffusion_models
from omnistage.cli.main import main
from omnistage.config.engine_args import VideoArgs
from omnistage.config.load import load_config, validate_config
from omnistage.protocol.errors import BadRequestError, ConfigError
from omnistage.protocol.params import (
    MAX_VIDEO_SECONDS,
    ParamKind,
    StageParams,
    VideoParams,
    decode,
    kind_of,
)
from omnistage.protocol.video_params import VideoJob, frame_count, video_job
from tests import params as P

ARGS = VideoArgs(max_generated_video_size=256 * 256, max_frames=81)


def _job(args: VideoArgs = ARGS, size_step: int = 16, **raw: Any) -> VideoJob:
    return video_job(P.video(raw).filming, args, size_step)


def _refused(param: str, args: VideoArgs = ARGS, size_step: int = 16, **raw: Any) -> str:
    with pytest.raises(BadRequestError) as err:
        _job(args, size_step, **raw)
    assert err.value.param == param
    return str(err.value)


# -- decoding ------------------------------------------------------------------------------


def test_the_video_engine_reads_the_video_group() -> None:
    assert kind_of("video") == ParamKind.VIDEO
    raw = {"seconds": 2.5, "fps": 8, "seed": 3, "temperature": 1.0, "n": 2}
    assert P.video(raw) == StageParams(video=VideoParams(seconds=2.5, fps=8, seed=3))
    assert decode(ParamKind.VIDEO, {"voice": "joe"}).empty
    assert StageParams().filming == VideoParams()


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"seconds": 0}, "seconds"),
        ({"seconds": MAX_VIDEO_SECONDS + 1}, "seconds"),
        ({"seconds": "long"}, "seconds"),
        ({"fps": 0}, "fps"),
        ({"fps": 61}, "fps"),
        ({"fps": 12.5}, "fps"),
        ({"num_frames": 0}, "num_frames"),
        ({"num_frames": 10**6}, "num_frames"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"guidance_scale": 101}, "guidance_scale"),
        ({"negative_prompt": "x" * 4001}, "negative_prompt"),
        ({"progress": "yes"}, "progress"),
        ({"size": 64}, "size"),
    ],
)
def test_a_bad_value_is_refused_where_it_is_decoded_naming_the_field(
    raw: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequestError) as err:
        P.video(raw)
    assert err.value.param == param


def test_a_later_layer_wins_and_unset_fields_stay_off_the_wire() -> None:
    defaults = P.video(fps=8, seconds=2.0)
    merged = defaults.merged(P.video(seconds=1.0, seed=4))
    assert merged.filming == VideoParams(seconds=1.0, fps=8, seed=4)
    wire = msgspec.msgpack.encode(merged)
    assert msgspec.msgpack.decode(wire) == {"video": {"seconds": 1.0, "fps": 8, "seed": 4}}
    assert msgspec.msgpack.decode(wire, type=StageParams) == merged


# -- the stage's defaults and limits -----------------------------------------------------


def test_an_empty_request_takes_the_stage_defaults() -> None:
    job = _job()
    assert job == VideoJob(size=None, fps=16, frames=80)  # 5 s at 16 fps
    assert _job(VideoArgs(default_fps=8, default_seconds=2.0)).frames == 16


def test_the_length_is_num_frames_else_seconds_times_fps() -> None:
    assert _job(seconds=2.0, fps=8).frames == 16
    assert _job(seconds=0.3, fps=10).frames == 3
    assert _job(seconds=2.0).frames == 32  # the stage's 16 fps
    assert _job(fps=4).frames == 20  # the stage's 5 s
    # num_frames wins over seconds; fps stays the rate the frames are played at.
    job = _job(num_frames=9, seconds=4.0, fps=24)
    assert (job.frames, job.fps) == (9, 24)


def test_lengths_past_the_stage_limit_are_refused_naming_what_the_client_gave() -> None:
    assert "at most 81 (max_frames)" in _refused("seconds", seconds=6.0)
    assert "num_frames 82" in _refused("num_frames", num_frames=82)
    assert _refused("seconds", seconds=3.0, fps=30)
    # Only fps given: the stage's default length at that rate is too long.
    assert "seconds 5.0 at 30 fps is 150 frames" in _refused("fps", fps=30)
    assert "less than one frame" in _refused("seconds", seconds=0.01, fps=8)


@pytest.mark.parametrize(
    ("size", "why"),
    [
        ("100x64", "multiples of 16"),
        ("33x32", "multiples of 16"),
        ("0x0", "at least 16"),
        ("512x512", "at most 65536 (max_generated_video_size)"),
        ("64x64x3", "WIDTHxHEIGHT"),
        ("autox", "WIDTHxHEIGHT"),
    ],
)
def test_bad_sizes_are_refused_naming_size(size: str, why: str) -> None:
    assert why in _refused("size", size=size)


def test_sizes_follow_the_pipeline_s_step_or_only_evenness_without_one() -> None:
    assert _job(size="64x32").size == (64, 32)
    assert _job(size="auto").size is None
    assert _job(size_step=2, size="34x18").size == (34, 18)  # a route, before any pipeline
    assert "multiples of 2" in _refused("size", size_step=2, size="33x18")
    assert "multiples of 32" in _refused("size", size_step=32, size="48x64")


# -- frame counts a pipeline makes ---------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "step", "most", "made"),
    [
        (9, 4, 241, 9),
        (80, 4, 241, 81),  # 5 s at 16 fps: Wan's 81
        (10, 4, 241, 9),
        (11, 4, 241, 13),  # a tie: the longer one
        (12, 4, 241, 13),
        (1, 4, 241, 1),
        (2, 4, 241, 1),
        (3, 4, 241, 5),
        (81, 4, 80, 77),  # never past the stage's max_frames
        (49, 8, 241, 49),
        (7, 1, 241, 7),  # no time compression: any count
        (7, 1, 5, 5),
    ],
)
def test_frame_counts_round_to_the_nearest_the_vae_makes(
    asked: int, step: int, most: int, made: int
) -> None:
    assert frame_count(asked, step, most) == made


# -- config --------------------------------------------------------------------------------


def _config(**engine_args: object) -> dict[str, Any]:
    stage = {
        "stage_id": 0,
        "name": "video",
        "engine": "video",
        "final_output": True,
        "output_modality": "video",
        "engine_args": engine_args,
    }
    return {"pipeline": "v", "stages": [stage]}


def test_video_engine_args_are_checked_when_the_config_loads() -> None:
    assert validate_config(_config()).stages[0].output_modality == "video"
    cases = [
        ({"default_size": "33x32"}, "engine_args.default_size"),
        ({"max_generated_video_size": 4096, "default_size": "128x128"}, "default_size"),
        ({"default_fps": 61}, "engine_args.default_fps"),
        ({"max_frames": 40}, "engine_args.max_frames"),  # the default 5 s at 16 fps is 80
        ({"default_seconds": 0.01, "default_fps": 8}, "engine_args.max_frames"),
        ({"vae_slicing": True}, "engine_args.vae_slicing"),
        ({"model_class_name": "not a class"}, "engine_args.model_class_name"),
    ]
    for args, where in cases:
        with pytest.raises(ConfigError, match=where):
            validate_config(_config(**args))
    sampling = _config()
    sampling["stages"][0]["default_sampling_params"] = {"fps": 0}
    with pytest.raises(ConfigError, match=r"default_sampling_params\.fps"):
        validate_config(sampling)


def test_the_video_pipeline_is_one_video_stage_whose_model_is_required() -> None:
    config = load_config("video")
    (stage,) = config.stages
    assert (stage.name, stage.engine, stage.output_modality) == ("video", "video", "video")
    assert stage.final_output and stage.reads_prompt == ("text", "image")
    assert "model" not in stage.engine_args
    with pytest.raises(UsageError) as err:
        check_diffusion_models(config, {0: 1}, "video")
    assert str(err.value).startswith("stage 0 'video' (engine video) needs engine_args.model")
    assert "no package ships video weights" in str(err.value)
    override = '\'{"0": {"engine_args": {"model": "/path/to/diffusers-dir"}}}\''
    assert f"omnistage serve video --stage-overrides {override}" in str(err.value)


def test_serve_video_without_a_model_exits_2_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "video", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnistage serve: error: stage 0 'video' (engine video) needs")

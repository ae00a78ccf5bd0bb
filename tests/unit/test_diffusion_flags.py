"""The diffusion flags of ``omnistage serve`` (cli/engine_flags.py), the painter
pipeline's config, and the thinker's config-level system prompt."""

from __future__ import annotations

import json

import pytest

from omnistage.cli.args import UsageError, build_parser, validate
from omnistage.cli.engine_flags import (
    apply_diffusion_flags,
    check_diffusion_models,
    diffusion_engine_args,
    headless_overrides,
)
from omnistage.cli.main import main
from omnistage.config.load import load_config

OVERRIDE_HINT = '--stage-overrides \'{"1": {"engine_args": {"model": "/path/to/diffusers-dir"}}}\''


def _args(*argv: str):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["serve", *argv])
    validate(args)
    return args


def test_the_painter_pipeline_is_a_thinker_feeding_a_diffusion_painter() -> None:
    config = load_config("painter")
    thinker, painter = config.stages
    assert (thinker.engine, painter.engine) == ("llm", "diffusion")
    assert painter.inputs == (0,) and painter.final_output
    assert painter.output_modality == "image"
    assert "image" in thinker.engine_args["system_prompt"]
    assert "model" not in painter.engine_args  # the operator brings the weights


def test_no_flags_leave_the_config_alone() -> None:
    config = load_config("painter")
    assert apply_diffusion_flags(config, _args("painter")) is config


def test_flags_land_in_the_engine_args_of_every_diffusion_stage(tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = _args(
        "painter",
        "--diffusers-load-kwargs",
        '{"variant": "fp16"}',
        "--diffusers-call-kwargs",
        '{"eta": 0.5}',
        "--model-class-name",
        "StableDiffusionPipeline",
        "--max-generated-image-size",
        "65536",
        "--vae-use-slicing",
        "--vae-use-tiling",
        "--enable-cpu-offload",
    )
    overrides = {"1": {"engine_args": {"diffusers_load_kwargs": {"use_safetensors": True}}}}
    config = apply_diffusion_flags(load_config("painter", overrides), args)
    assert config.stages[1].engine_args == {
        "max_concurrent": 1,
        # JSON flags merge key by key into what the config (or an override) had.
        "diffusers_load_kwargs": {"use_safetensors": True, "variant": "fp16"},
        "diffusers_call_kwargs": {"eta": 0.5},
        "model_class_name": "StableDiffusionPipeline",
        "max_generated_image_size": 65536,
        "vae_use_slicing": True,
        "vae_use_tiling": True,
        "enable_cpu_offload": True,
    }
    assert "vae_use_slicing" not in config.stages[0].engine_args


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--diffusers-load-kwargs", "{bad"], "--diffusers-load-kwargs: not valid JSON"),
        (["--diffusers-call-kwargs", "[1]"], "--diffusers-call-kwargs must be a JSON object"),
        (["--model-class-name", "a-b"], "--model-class-name must be a Python class name"),
        (["--max-generated-image-size", "100"], "--max-generated-image-size must be >= 4096"),
    ],
)
def test_bad_flag_values_are_usage_errors_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        _args("painter", *argv)


def test_flags_on_a_pipeline_without_a_diffusion_stage_are_an_error() -> None:
    args = _args("voice", "--vae-use-slicing", "--model-class-name", "X")
    with pytest.raises(UsageError) as err:
        apply_diffusion_flags(load_config("voice"), args)
    assert str(err.value) == (
        "--model-class-name, --vae-use-slicing: pipeline 'voice' has no diffusion stage to apply to"
    )


def test_a_local_diffusion_stage_without_a_model_is_refused_with_the_override_to_give(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    config = load_config("painter")
    with pytest.raises(UsageError) as err:
        check_diffusion_models(config, {0: 1, 1: 1}, "painter")
    assert "stage 1 'painter'" in str(err.value)
    assert f"omnistage serve painter {OVERRIDE_HINT}" in str(err.value)
    # Served by headless replicas only: they may bring the path in their own overrides.
    check_diffusion_models(config, {0: 1, 1: 0}, "painter")
    missing = load_config("painter", {"1": {"engine_args": {"model": str(tmp_path / "nope")}}})
    with pytest.raises(UsageError, match="is not a directory"):
        check_diffusion_models(missing, {1: 1}, "painter")
    there = load_config("painter", {"1": {"engine_args": {"model": str(tmp_path)}}})
    check_diffusion_models(there, {1: 1}, "painter")


def test_serve_exits_2_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "painter", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnistage serve: error: stage 1 'painter' (engine diffusion) needs")
    assert OVERRIDE_HINT in err
    assert main(["serve", "echo", "--enable-cpu-offload"]) == 2
    assert "--enable-cpu-offload: pipeline 'echo' has no diffusion stage" in capsys.readouterr().err
    assert main(["serve", "painter", "--diffusers-call-kwargs", "nope"]) == 2
    assert "--diffusers-call-kwargs: not valid JSON" in capsys.readouterr().err
    bad = json.dumps({"1": {"engine_args": {"model": "/x"}}})
    assert main(["serve", "painter", "--stage-overrides", bad, "--vae-use-tiling"]) == 2
    assert "engine_args.model '/x' is not a directory" in capsys.readouterr().err


def test_a_headless_replica_adds_the_flags_to_its_own_overrides() -> None:
    args = _args(
        "--headless",
        "--stage-id",
        "1",
        "-oma",
        "127.0.0.1",
        "-omp",
        "25000",
        "--vae-use-tiling",
        "--diffusers-call-kwargs",
        '{"eta": 1}',
    )
    assert diffusion_engine_args(args) == {
        "diffusers_call_kwargs": {"eta": 1},
        "vae_use_tiling": True,
    }
    own = {"devices": "cuda:1", "engine_args": {"model": "/m", "diffusers_call_kwargs": {"x": 2}}}
    assert headless_overrides(own, args) == {
        "devices": "cuda:1",
        "engine_args": {
            "model": "/m",
            "diffusers_call_kwargs": {"x": 2, "eta": 1},
            "vae_use_tiling": True,
        },
    }
    assert headless_overrides({}, _args("painter")) == {}


def test_the_llm_system_prompt_goes_first_unless_the_client_sent_one() -> None:
    pytest.importorskip("torch")
    from omnistage.engines.llm.prompts import with_system
    from omnistage.protocol.messages import ChatMessage, Prompt

    user = ChatMessage("user", "a cat")
    out = with_system(Prompt(messages=[user]), "Describe it.")
    assert out.messages == [ChatMessage("system", "Describe it."), user]
    own = Prompt(messages=[ChatMessage("system", "Mine."), user])
    assert with_system(own, "Describe it.") is own
    text = Prompt(text="raw completion")
    assert with_system(text, "Describe it.") is text

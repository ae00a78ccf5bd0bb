"""Deploy config loading: built-ins, YAML files, error paths, --stage-overrides."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from omnistage.config.load import apply_stage_overrides, builtin_names, load_config
from omnistage.config.schema import DeployConfig
from omnistage.protocol.errors import ConfigError

GOOD = """\
pipeline: test
stages:
  - stage_id: 0
    name: a
    engine: echo
  - stage_id: 1
    name: b
    engine: echo
    inputs: [0]
    final_output: true
"""


def write(tmp_path: Path, text: str, name: str = "deploy.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def load_error(source: str, overrides=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    return info.value


# -- built-ins ---------------------------------------------------------------------------


def test_builtin_names_include_the_shipped_pipelines():
    assert {"echo", "echo-1stage", "echo-fanout"} <= set(builtin_names())


@pytest.mark.parametrize("name", builtin_names())
def test_every_builtin_loads(name):
    config = load_config(name)
    assert isinstance(config, DeployConfig)
    assert config.pipeline == name
    assert any(s.final_output for s in config.stages)


def test_default_pipeline_is_the_voice_pipeline():
    config = load_config()
    assert config.pipeline == "voice"
    assert [(s.name, s.engine, s.output_modality) for s in config.stages] == [
        ("thinker", "llm", "text"),
        ("talker", "tts", "audio"),
        ("listener", "asr", "text"),
    ]
    assert config.stage(1).inputs == (0,)
    # The listener feeds the thinker; a typed chat skips it (the thinker reads text).
    assert config.stage(0).inputs == (2,)
    assert config.stage(0).reads_prompt == ("text",)
    assert config.stage(2).reads_prompt == ("audio",)
    assert [s.name for s in config.stages if s.final_output] == ["thinker", "talker"]


def test_echo_builtin_is_three_stage_chain_with_stage_2_final():
    config = load_config("echo")
    assert config.stage_ids == [0, 1, 2]
    assert [s.inputs for s in config.stages] == [(), (0,), (1,)]
    assert [s.stage_id for s in config.stages if s.final_output] == [2]
    assert all(s.engine == "echo" for s in config.stages)


def test_echo_fanout_has_one_stage_feeding_two_final_stages():
    config = load_config("echo-fanout")
    sources = [s for s in config.stages if not s.inputs]
    assert [s.stage_id for s in sources] == [0]
    assert not sources[0].final_output
    finals = [s for s in config.stages if s.final_output]
    assert len(finals) == 2
    assert all(s.inputs == (0,) for s in finals)


def test_yaml_file_loads_by_path(tmp_path):
    config = load_config(write(tmp_path, GOOD))
    assert config.pipeline == "test"
    assert config.stage(1).inputs == (0,)
    assert config.stage(0).replicas == 1  # default


def test_stage_lookup_of_unknown_id_raises_key_error():
    with pytest.raises(KeyError):
        load_config("echo").stage(9)


# -- errors name the YAML path -----------------------------------------------------------


def test_negative_replicas_error_names_path(tmp_path):
    path = write(tmp_path, GOOD.replace("    inputs: [0]\n", "    inputs: [0]\n    replicas: -1\n"))
    err = load_error(path)
    assert "stages[1].replicas" in str(err)
    assert path in str(err)


def test_unknown_engine_error_names_path(tmp_path):
    err = load_error(write(tmp_path, GOOD.replace("engine: echo", "engine: warp", 1)))
    assert "stages[0].engine" in str(err)
    assert "warp" in str(err)


def test_unknown_upstream_error_names_path(tmp_path):
    err = load_error(write(tmp_path, GOOD.replace("inputs: [0]", "inputs: [5]")))
    assert "stages[1].inputs[0]" in str(err)
    assert "5" in err.message


def test_stage_feeding_itself_is_rejected(tmp_path):
    err = load_error(write(tmp_path, GOOD.replace("inputs: [0]", "inputs: [1]")))
    assert "stages[1].inputs[0]" in str(err)


def test_cycle_is_rejected(tmp_path):
    text = """\
    pipeline: loop
    stages:
      - {stage_id: 0, name: a, engine: echo, inputs: [2]}
      - {stage_id: 1, name: b, engine: echo, inputs: [0]}
      - {stage_id: 2, name: c, engine: echo, inputs: [1], final_output: true}
    """
    err = load_error(write(tmp_path, text))
    assert "cycle" in str(err)


def test_no_final_stage_is_rejected(tmp_path):
    err = load_error(write(tmp_path, GOOD.replace("    final_output: true\n", "")))
    assert "final_output" in str(err)
    assert "stages" in str(err)


def test_duplicate_stage_id_error_names_path(tmp_path):
    err = load_error(write(tmp_path, GOOD.replace("stage_id: 1", "stage_id: 0")))
    assert "stages[1].stage_id" in str(err)
    assert "duplicate" in str(err)


def test_unknown_field_error_names_path(tmp_path):
    err = load_error(write(tmp_path, GOOD.replace("    name: a\n", "    name: a\n    bogus: 1\n")))
    assert "stages[0].bogus" in str(err)


def test_bad_echo_engine_arg_error_names_path(tmp_path):
    bad = GOOD.replace("    name: a\n", "    name: a\n    engine_args: {num_chunks: 0}\n")
    err = load_error(write(tmp_path, bad))
    assert "stages[0].engine_args.num_chunks" in str(err)


def test_unknown_echo_engine_arg_error_names_path(tmp_path):
    bad = GOOD.replace("    name: a\n", "    name: a\n    engine_args: {chunks: 3}\n")
    err = load_error(write(tmp_path, bad))
    assert "stages[0].engine_args.chunks" in str(err)


def test_file_that_is_not_a_mapping_is_rejected(tmp_path):
    path = write(tmp_path, "- just\n- a list\n")
    err = load_error(path)
    assert "mapping" in str(err)
    assert path in str(err)


def test_invalid_yaml_is_rejected(tmp_path):
    path = write(tmp_path, "pipeline: [unclosed\nstages: {\n")
    err = load_error(path)
    assert "YAML" in str(err)
    assert path in str(err)


def test_missing_yaml_file_is_rejected(tmp_path):
    path = str(tmp_path / "nope.yaml")
    err = load_error(path)
    assert path in str(err)
    assert "cannot read" in str(err)


def test_unknown_builtin_name_is_rejected_listing_builtins():
    err = load_error("no-such-pipeline")
    assert "no-such-pipeline" in str(err)
    assert "echo-fanout" in str(err)


# -- --stage-overrides -------------------------------------------------------------------


def test_overrides_merge_engine_args_key_by_key():
    config = load_config("echo", json.dumps({"0": {"engine_args": {"suffix": "!"}}}))
    assert config.stage(0).engine_args == {"num_chunks": 4, "suffix": "!"}


def test_overrides_replace_other_fields():
    config = load_config("echo", '{"2": {"replicas": 3, "inputs": [0]}, "1": {"name": "t2"}}')
    assert config.stage(2).replicas == 3
    assert config.stage(2).inputs == (0,)
    assert config.stage(1).name == "t2"
    assert config.stage(0).replicas == 1  # untouched


def test_overrides_accept_a_dict():
    config = load_config("echo", {"1": {"replicas": 0}})
    assert config.stage(1).replicas == 0


def test_overrides_do_not_mutate_the_raw_config():
    raw = {
        "pipeline": "p",
        "stages": [{"stage_id": 0, "name": "a", "engine": "echo", "engine_args": {"x": 1}}],
    }
    out = apply_stage_overrides(raw, {"0": {"engine_args": {"y": 2}, "name": "z"}})
    assert out["stages"][0]["engine_args"] == {"x": 1, "y": 2}
    assert raw["stages"][0] == {
        "stage_id": 0,
        "name": "a",
        "engine": "echo",
        "engine_args": {"x": 1},
    }


def test_overrides_result_is_validated():
    err = load_error("echo", '{"1": {"replicas": -2}}')
    assert "stages[1].replicas" in str(err)


@pytest.mark.parametrize(
    ("overrides", "detail"),
    [
        ("{not json", "JSON"),
        ("[1, 2]", "object"),
        ('{"7": {"replicas": 2}}', "7"),
        ('{"x": {"replicas": 2}}', "x"),
        ('{"0": {"stage_id": 5}}', "stage_id"),
        ('{"0": 3}', "object"),
    ],
    ids=[
        "invalid-json",
        "non-object",
        "unknown-stage",
        "non-numeric-key",
        "stage-id",
        "not-fields",
    ],
)
def test_bad_overrides_raise_config_error_mentioning_flag(overrides, detail):
    err = load_error("echo", overrides)
    assert "--stage-overrides" in str(err)
    assert detail in str(err)


# -- frozen ------------------------------------------------------------------------------


def test_loaded_config_is_frozen():
    config = load_config("echo")
    with pytest.raises((ValidationError, TypeError)):
        config.pipeline = "other"
    with pytest.raises((ValidationError, TypeError)):
        config.stages[0].replicas = 5
    with pytest.raises(TypeError):
        config.stages[0:1] = ()  # stages is a tuple
    assert load_config("echo").stages[0].replicas == 1


def test_overrides_do_not_hide_an_invalid_stage_entry(tmp_path):
    path = write(tmp_path, GOOD + "  - not-a-stage\n")
    assert "stages[2]" in str(load_error(path))
    err = load_error(path, '{"0": {"replicas": 2}}')
    assert "stages[2]" in str(err)

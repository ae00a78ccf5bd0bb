"""Every engine name is known everywhere a stage's engine is looked up."""

from __future__ import annotations

import pytest

from omnistage.config.engine_args import ENGINE_ARGS
from omnistage.config.load import validate_config
from omnistage.engines import ENGINE_CLASSES
from omnistage.protocol.enums import EngineName
from omnistage.protocol.errors import ConfigError
from omnistage.protocol.params import PARAM_KIND


@pytest.mark.parametrize("table", [ENGINE_ARGS, ENGINE_CLASSES, PARAM_KIND])
def test_every_engine_name_has_an_entry(table: dict) -> None:
    assert set(table) == set(EngineName)


def _config(engine: str, defaults: dict) -> dict:
    return {
        "pipeline": "p",
        "stages": [
            {
                "stage_id": 0,
                "name": "s",
                "engine": engine,
                "final_output": True,
                "default_sampling_params": defaults,
            }
        ],
    }


def test_sampling_defaults_are_checked_as_the_engine_reads_them() -> None:
    validate_config(_config("echo", {"temperature": 0.5, "num_chunks": 2}))
    with pytest.raises(
        ConfigError,
        match=r"stages\[0\]\.default_sampling_params\.temperature: Expected `float` <= 2\.0",
    ):
        validate_config(_config("echo", {"temperature": 9}))
    with pytest.raises(ConfigError, match=r"default_sampling_params\.speed"):
        validate_config(_config("tts", {"speed": "fast"}))

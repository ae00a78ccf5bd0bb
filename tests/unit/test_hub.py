"""Models by hub id (config/hub.py): what counts as one, fetching it from an HF-compatible
endpoint into the HF cache, the cache alone when offline, and the errors when neither has it.
The hub is tests/hf_endpoint.py on 127.0.0.1."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnistage import envs
from omnistage.config import hub
from omnistage.config.load import load_config
from omnistage.engines.llm import weights
from omnistage.protocol.errors import ConfigError, EngineError
from tests.hf_endpoint import HfEndpoint, Repo, hf_endpoint

OMNI = Repo({"config.json": json.dumps({"model_type": "qwen2_5_omni"}).encode()})
LLM = Repo({"config.json": b'{"model_type": "llama"}', "weights/model.bin": b"w" * 4096})


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HfEndpoint]:
    """The local hub, with HF_ENDPOINT at it, the HF cache in tmp_path, and online."""
    import huggingface_hub.constants

    with hf_endpoint({"org/tiny-omni": OMNI, "org/tiny-llm": LLM}) as served:
        monkeypatch.setenv("HF_ENDPOINT", served.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        # tests/conftest.py sets HF_HUB_OFFLINE=1 for the session, which huggingface_hub
        # may have read on import.
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield served


def _downloads(served: HfEndpoint) -> int:
    return sum(n for what, n in served.requests.items() if "/resolve/" in what)


@pytest.mark.parametrize(
    ("model", "want"),
    [
        ("Qwen/Qwen2.5-Omni-3B", hub.HubId("Qwen/Qwen2.5-Omni-3B")),
        ("org/name@v1.0", hub.HubId("org/name", "v1.0")),
        ("org/name@refs/pr/3", hub.HubId("org/name", "refs/pr/3")),
        ("voice", None),
        ("smollm2", None),
        ("./org/name", None),
        ("/abs/org/name", None),
        ("~/org/name", None),
        ("org/sub/name", None),
        ("configs/pipeline.yaml", None),
        ("models/model.gguf", None),
        ("../org/name", None),
    ],
)
def test_what_is_a_hub_id(model: str, want: hub.HubId | None) -> None:
    assert hub.parse_hub_id(model) == want


def test_an_existing_local_path_is_never_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.parse_hub_id("org/name") is None
    assert hub.resolve("org/name") == Path("org/name")


def test_a_hub_id_is_fetched_then_served_from_the_cache(endpoint: HfEndpoint) -> None:
    directory = hub.resolve("org/tiny-llm")
    assert directory.name == LLM.commit
    assert (directory / "weights" / "model.bin").read_bytes() == b"w" * 4096
    assert _downloads(endpoint) == 4  # HEAD and GET of each file
    assert str(directory).startswith(envs.hf_hub_cache())
    # The llm engine's model names resolve the same way.
    assert weights.resolve_model("org/tiny-llm") == directory
    assert _downloads(endpoint) == 4

    endpoint.requests.clear()
    pinned = f"org/tiny-llm@{LLM.commit}"
    assert hub.resolve(pinned) == directory
    assert not endpoint.requests  # a cached commit needs no hub


def test_offline_a_cached_model_needs_no_hub(
    endpoint: HfEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = hub.resolve("org/tiny-omni")
    endpoint.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert hub.resolve("org/tiny-omni") == directory
    assert not endpoint.requests


def test_offline_and_not_cached_says_what_to_do(
    endpoint: HfEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as caught:
        hub.resolve("org/tiny-llm")
    message = str(caught.value)
    assert message.startswith("org/tiny-llm: not a local path, not in the HF cache")
    for hint in ("HF_HUB_OFFLINE is set", "set HF_ENDPOINT", "download it", "local path"):
        assert hint in message
    assert not endpoint.requests
    with pytest.raises(EngineError, match="model org/tiny-llm: not a local path"):
        weights.resolve_model("org/tiny-llm")


def test_an_unreachable_hub_fails_at_once(
    endpoint: HfEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"http://127.0.0.1:9 did not answer .* set HF_ENDPOINT"):
        hub.resolve("org/tiny-llm")
    assert time.monotonic() - started < 10


def test_the_hub_says_what_it_lacks(endpoint: HfEndpoint) -> None:
    with pytest.raises(ConfigError, match="has no model 'org/missing'"):
        hub.resolve("org/missing")
    with pytest.raises(ConfigError, match="has 'org/tiny-llm' but no revision 'v9'"):
        hub.resolve("org/tiny-llm@v9")


def test_a_hub_id_picks_its_pipeline_and_pins_the_commit(endpoint: HfEndpoint) -> None:
    config = load_config("org/tiny-omni")
    assert config.pipeline == "qwen2_5_omni"
    models = {stage.engine_args["model"] for stage in config.stages}
    assert models == {f"org/tiny-omni@{OMNI.commit}"}


def test_the_engines_own_offline_switch_is_not_the_users(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "")  # so that undoing restores what was there
        monkeypatch.delenv(name)
    monkeypatch.setattr(envs, "_hub_switches_set", set())
    envs.keep_model_hubs_offline()
    assert envs.hub_offline() is False
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(envs, "_hub_switches_set", set())
    assert envs.hub_offline() is True

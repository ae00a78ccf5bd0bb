"""``omnistage serve org/name``: the head fetches the checkpoint from the hub HF_ENDPOINT
names (tests/hf_endpoint.py serving the tiny Qwen2.5-Omni) into the HF cache, picks the
pipeline from its config.json, and the replicas load the pinned commit from that cache;
started again with HF_HUB_OFFLINE=1 it serves from the cache alone."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hf_endpoint import HfEndpoint, Repo, hf_endpoint
from tests.integration.harness import HeadProc
from tests.models.test_omni_staged import reference
from tests.omni_tiny import build_tiny_omni

# Each test starts a head of three replicas, which a loaded machine takes a while to import.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_TOKENS = 6
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_omni(tmp_path_factory.mktemp("omni") / "qwen2.5-omni-tiny")


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hf-home"))


@pytest.fixture(scope="module")
def want_text(omni_dir: Path) -> str:
    return reference(omni_dir, MESSAGES, "Chelsie")[0]


@pytest.fixture(scope="module")
def served_hub(omni_dir: Path) -> Iterator[HfEndpoint]:
    with hf_endpoint({"org/tiny-omni": Repo.from_dir(omni_dir)}) as served:
        yield served


def _chat_text(head: HeadProc) -> str:
    model = head.client.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": MAX_TOKENS}
    response = head.client.post("/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def _start(tmp_path: Path, name: str, env: dict[str, str]) -> HeadProc:
    mp = pytest.MonkeyPatch()
    for key, value in {**env, "OMP_NUM_THREADS": "1"}.items():
        mp.setenv(key, value)  # the head and its replicas inherit them
    try:
        head = HeadProc(tmp_path, "org/tiny-omni", name=name)
    finally:
        mp.undo()
    try:
        head.wait_healthy(timeout=240)
    except BaseException:
        head.stop()
        raise
    return head


def _snapshot(hf_home: str, omni_dir: Path) -> Path:
    commit = Repo.from_dir(omni_dir).commit
    return Path(hf_home) / "hub" / "models--org--tiny-omni" / "snapshots" / commit


def test_serve_a_hub_id_fetches_it_once_and_answers(
    served_hub: HfEndpoint, omni_dir: Path, hf_home: str, want_text: str, tmp_path: Path
) -> None:
    online = {"HF_ENDPOINT": served_hub.url, "HF_HOME": hf_home, "HF_HUB_OFFLINE": "0"}
    head = _start(tmp_path, "online-head", online)
    try:
        assert (_snapshot(hf_home, omni_dir) / "config.json").exists()
        # Each file was fetched once, by the head: the replicas found the pinned commit cached.
        gets = [n for what, n in served_hub.requests.items() if what.startswith("GET /org/")]
        assert len(gets) == len(list(omni_dir.iterdir())) and set(gets) == {1}
        log = head.log()
        assert f"fetching org/tiny-omni from {served_hub.url}" in log
        assert "Fetching 8 files" in log  # huggingface_hub's progress
        stages = {s["stage_id"]: s["name"] for s in head.stages()["stages"]}
        assert [stages[i] for i in sorted(stages)] == ["thinker", "talker", "token2wav"]
        assert _chat_text(head) == want_text
    finally:
        head.stop()


def test_a_second_start_offline_serves_from_the_cache(
    served_hub: HfEndpoint, omni_dir: Path, hf_home: str, want_text: str, tmp_path: Path
) -> None:
    if not _snapshot(hf_home, omni_dir).exists():  # run alone: the cache a start fills
        prime = "from omnistage.config import hub; hub.resolve('org/tiny-omni')"
        env = {**os.environ, "HF_ENDPOINT": served_hub.url, "HF_HOME": hf_home}
        subprocess.run(
            [sys.executable, "-c", prime], env={**env, "HF_HUB_OFFLINE": "0"}, check=True
        )
    served_hub.requests.clear()
    # HF_ENDPOINT at a port nothing listens on: the cache alone serves.
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": hf_home, "HF_HUB_OFFLINE": "1"}
    head = _start(tmp_path, "offline-head", offline)
    try:
        assert _chat_text(head) == want_text
        assert not served_hub.requests
        assert "fetching" not in head.log()
    finally:
        head.stop()

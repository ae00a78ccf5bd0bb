"""Fixtures shared by the model tests.

Starting the default ``voice`` pipeline (thinker, talker, listener) costs tens of seconds
of model loading, so the files that only send it requests share one head per session.
Tests that kill replicas or need other flags start their own head, so this one stays
healthy: the tests that share it read counters as deltas, never as absolute values.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.integration.harness import HeadProc


@pytest.fixture(scope="session")
def voice_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HeadProc]:
    """``omnistage serve voice`` with its default flags, shared by the whole session."""
    head = HeadProc(tmp_path_factory.mktemp("voice"), "voice", name="voice-head")
    try:
        head.wait_healthy(timeout=300)  # the first start converts the GGUF (~30 s)
        yield head
    finally:
        head.stop()


@pytest.fixture(scope="session")
def voice_client(voice_head: HeadProc) -> openai.OpenAI:
    """The official OpenAI client on the shared voice head."""
    return openai.OpenAI(base_url=f"{voice_head.url}/v1", api_key="x", max_retries=0, timeout=180)


@pytest.fixture(scope="session")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Qwen2.5-Omni checkpoint (tests/omni_tiny.py)."""
    from tests.omni_tiny import build_tiny_omni

    return build_tiny_omni(tmp_path_factory.mktemp("omni") / "qwen2.5-omni-tiny")


@pytest.fixture(scope="session")
def omni_head(omni_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HeadProc]:
    """``omnistage serve`` of the tiny checkpoint (its own staged pipeline), greedy talker,
    two talker replicas taken in turn, one thread per replica, images fetched from
    127.0.0.1: shared by the files that only send it requests (chat, Responses,
    Realtime); a test that kills a replica starts its own."""
    from tests.omni_tiny import OMNI_MAX_CODES, one_thread_head

    talker = {"do_sample": False, "max_new_tokens": OMNI_MAX_CODES}
    overrides = {"1": {"replicas": 2, "lb_policy": "round-robin", "engine_args": talker}}
    head = one_thread_head(
        tmp_path_factory.mktemp("omni-head"),
        omni_dir,
        overrides,
        "omni-head",
        "--allowed-media-domains",
        "127.0.0.1",
    )
    try:
        yield head
    finally:
        head.stop()

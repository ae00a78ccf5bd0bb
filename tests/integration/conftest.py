from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import HeadProc


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("omni")


@pytest.fixture(scope="module")
def echo_head(module_tmp: Path) -> Iterator[HeadProc]:
    head = HeadProc(module_tmp, "echo", name="echo-head")
    try:
        head.wait_healthy()
        yield head
    finally:
        head.stop()

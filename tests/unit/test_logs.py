"""The logging set-up every omnistage process shares."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from omnistage.logs import setup_logging


@pytest.fixture
def restored_root() -> Iterator[None]:
    root, uvicorn = logging.getLogger(), logging.getLogger("uvicorn.error")
    level, handlers, uvicorn_level = root.level, root.handlers[:], uvicorn.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    uvicorn.setLevel(uvicorn_level)


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_debug_leaves_out_websocket_frames_and_credentials(restored_root: None) -> None:
    setup_logging("DEBUG")
    setup_logging("DEBUG")  # a second set-up adds no second filter
    uvicorn = logging.getLogger("uvicorn.error")
    uvicorn.setLevel(logging.DEBUG)  # as uvicorn's own set-up at --log-level DEBUG
    kept = _Kept()
    uvicorn.addHandler(kept)
    try:
        # As the websockets library logs through uvicorn's logger (a LoggerAdapter).
        frames = logging.LoggerAdapter(uvicorn, {"websocket": None})
        frames.debug("> %s", 'TEXT \'{"type":"session.created"}\' [30 bytes]')
        frames.debug("< %s", "BINARY 00 01 [2 bytes]")
        frames.debug("= connection is OPEN")
        frames.info("> %s", "not a frame line at INFO")
        # The handshake's headers: a credential's value never reaches the log.
        frames.debug("< %s: %s", "Authorization", "Bearer sk-secret")
        frames.debug("< %s: %s", "sec-websocket-protocol", "openai-insecure-api-key.sk-secret")
        frames.debug("< %s: %s", "upgrade", "websocket")
    finally:
        uvicorn.removeHandler(kept)
    assert kept.lines == [
        "= connection is OPEN",
        "> not a frame line at INFO",
        "< Authorization: [redacted]",
        "< sec-websocket-protocol: [redacted]",
        "< upgrade: websocket",
    ]
    assert len(uvicorn.filters) == 1

"""Logging set-up shared by every omnistage process."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from omnistage import envs

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | None = None) -> None:
    level = (level or envs.log_level() or "INFO").upper()
    logging.basicConfig(level=level, format=FORMAT, force=True)
    # Per-request access lines would drown the control-plane events operators need.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    frames = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, NoFrames) for f in frames.filters):
        frames.addFilter(NoFrames())


class NoFrames(logging.Filter):
    """The websockets library's DEBUG lines, as it logs them through uvicorn's logger:

    - its line per frame ("> TEXT '{...}' [846 bytes]") is dropped: at ``--log-level
      DEBUG`` a voice session would write one per 20 ms of audio each way, drowning
      omnistage's own DEBUG lines and slowing the session it traces;
    - its line per handshake header keeps the header's name but not the value of one
      that carries a credential: the API key comes as ``authorization`` or, from a
      browser, as the ``openai-insecure-api-key.<key>`` subprotocol, and a log is no
      place for it.
    """

    FRAME_LINES = frozenset({"< %s", "> %s"})
    HEADER_LINES = frozenset({"< %s: %s", "> %s: %s"})
    SECRET_HEADERS = frozenset(
        {"authorization", "proxy-authorization", "cookie", "set-cookie", "sec-websocket-protocol"}
    )

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.DEBUG:
            return True
        if record.msg in self.FRAME_LINES:
            return False
        args = record.args
        header = record.msg in self.HEADER_LINES and isinstance(args, tuple) and len(args) == 2
        if header and str(args[0]).lower() in self.SECRET_HEADERS:  # type: ignore[index]
            record.args = (args[0], "[redacted]")  # type: ignore[index]
        return True


class Throttled:
    """Warnings about bad input, at most ``burst`` per ``window_s``, then a count.

    A peer that floods garbage must not turn the log into the bottleneck (or fill the
    disk): the first few are logged in full, the rest are summed up per window.
    """

    def __init__(
        self,
        logger: logging.Logger,
        burst: int = 5,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._window_start = clock()
        self._count = 0

    def warning(self, msg: str, *args: object) -> None:
        now = self._clock()
        if now - self._window_start >= self._window_s:
            suppressed = self._count - self._burst
            if suppressed > 0:
                self._log.warning(
                    "%d more bad messages dropped in the last %.0fs", suppressed, self._window_s
                )
            self._window_start, self._count = now, 0
        self._count += 1
        if self._count <= self._burst:
            self._log.warning(msg, *args)


def tag_logs(stage_id: int, replica_id: int) -> None:
    """Prefix this process's log lines with its stage and replica (replacing an earlier
    prefix: a replica that rejoins may get another id)."""
    prefix = f"[stage {stage_id} replica {replica_id}] "
    for handler in logging.getLogger().handlers:
        fmt = (handler.formatter._fmt if handler.formatter else None) or "%(message)s"
        base = getattr(handler, "_omni_untagged_fmt", fmt)
        handler._omni_untagged_fmt = base  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter(base.replace("%(message)s", prefix + "%(message)s")))

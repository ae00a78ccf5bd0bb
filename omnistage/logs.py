"""Logging set-up shared by every omnistage process."""

from __future__ import annotations

import logging

from omnistage import envs

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | None = None) -> None:
    level = (level or envs.log_level() or "INFO").upper()
    logging.basicConfig(level=level, format=FORMAT, force=True)
    # Per-request access lines would drown the control-plane events operators need.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)

"""Bad-input warnings are throttled per window and summarized."""

from __future__ import annotations

import logging

from omnistage.logs import Throttled
from tests.unit.fakes import FakeClock


def test_burst_then_summary(caplog) -> None:  # type: ignore[no-untyped-def]
    clock = FakeClock(0.0)
    throttled = Throttled(logging.getLogger("t"), burst=3, window_s=10, clock=clock)
    with caplog.at_level(logging.WARNING, logger="t"):
        for i in range(50):
            throttled.warning("bad %d", i)
        assert [r.getMessage() for r in caplog.records] == ["bad 0", "bad 1", "bad 2"]
        clock.now = 11
        throttled.warning("bad again")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[3:] == ["47 more bad messages dropped in the last 10s", "bad again"]

"""The restart policy for local replicas, with a fake clock."""

from __future__ import annotations

import pytest

from omnistage.launch.restart import RestartPolicy
from tests.unit.fakes import FakeClock


def test_on_failure_backs_off_while_crashing_and_resets_once_stable() -> None:
    clock = FakeClock()
    policy = RestartPolicy("on-failure", clock)
    key = (1, 0)
    delays = []
    for _ in range(7):
        policy.started(key)
        clock.now += 2  # crashes two seconds after each start
        delays.append(policy.delay_after_exit(key, code=-9))
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    policy.started(key)
    clock.now += 120  # ran fine for two minutes, then crashed once
    assert policy.delay_after_exit(key, code=1) == 1


def test_clean_exits_and_never_are_not_restarted() -> None:
    policy = RestartPolicy("on-failure", FakeClock())
    assert policy.delay_after_exit((0, 0), code=0) is None
    assert RestartPolicy("never", FakeClock()).delay_after_exit((0, 0), code=1) is None
    assert RestartPolicy("always", FakeClock()).delay_after_exit((0, 0), code=0) == 1


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="on-failure"):
        RestartPolicy("sometimes", FakeClock())

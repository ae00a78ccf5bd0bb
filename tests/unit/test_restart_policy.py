"""The restart policy for local replicas, with a fake clock (no sleeping)."""

from __future__ import annotations

import pytest

from omnistage.launch.restart import SETTLE_S, RestartPolicy
from tests.unit.fakes import FakeClock

KEY = (1, 0)


def test_failures_before_up_back_off_exponentially_up_to_the_cap() -> None:
    clock = FakeClock()
    policy = RestartPolicy("on-failure", clock)
    delays = []
    for _ in range(7):
        policy.started(KEY)
        clock.now += 2  # crashes two seconds after each start, never UP
        delays.append(policy.delay_after_exit(KEY, code=-9))
    assert delays == [1, 2, 4, 8, 16, 30, 30]


def test_a_long_run_before_up_is_still_a_loop() -> None:
    """Time alone is not health: a replica that never came UP backs off however long
    its failed start took (a model that loads for minutes, then crashes)."""
    clock = FakeClock()
    policy = RestartPolicy("on-failure", clock)
    policy.started(KEY)
    clock.now += 120
    assert policy.delay_after_exit(KEY, code=1) == 1
    policy.started(KEY)
    clock.now += 120
    assert policy.delay_after_exit(KEY, code=1) == 2


def test_a_replica_that_served_restarts_at_once_each_time() -> None:
    """Killed every 15 s after serving: bad luck, not a loop; no backoff builds up."""
    clock = FakeClock()
    policy = RestartPolicy("on-failure", clock)
    for _ in range(6):
        policy.started(KEY)
        clock.now += 4  # loading
        policy.up(KEY)
        clock.now += 15  # served
        assert policy.delay_after_exit(KEY, code=-9) == 0


def test_failing_soon_after_up_backs_off_and_a_settled_run_resets_it() -> None:
    clock = FakeClock()
    policy = RestartPolicy("on-failure", clock)
    delays = []
    for _ in range(4):
        policy.started(KEY)
        policy.up(KEY)
        clock.now += SETTLE_S - 1  # its first requests crash it
        delays.append(policy.delay_after_exit(KEY, code=-11))
    assert delays == [1, 2, 4, 8]
    policy.started(KEY)
    policy.up(KEY)
    clock.now += SETTLE_S
    assert policy.delay_after_exit(KEY, code=-9) == 0
    # The next loop starts from the base delay again.
    policy.started(KEY)
    clock.now += 1
    assert policy.delay_after_exit(KEY, code=1) == 1


def test_the_settling_time_counts_from_up_not_from_the_start() -> None:
    clock = FakeClock()
    policy = RestartPolicy("on-failure", clock)
    policy.started(KEY)
    clock.now += 60  # a slow load
    policy.up(KEY)
    clock.now += 1
    assert not policy.settled(KEY)
    assert policy.delay_after_exit(KEY, code=-9) == 1


def test_replicas_are_judged_apart() -> None:
    clock = FakeClock()
    policy = RestartPolicy("on-failure", clock)
    other = (1, 1)
    for key in (KEY, other):
        policy.started(key)
    policy.up(other)
    clock.now += 30
    assert policy.delay_after_exit(KEY, code=1) == 1
    assert policy.delay_after_exit(other, code=1) == 0


def test_clean_exits_and_never_are_not_restarted() -> None:
    policy = RestartPolicy("on-failure", FakeClock())
    assert policy.delay_after_exit((0, 0), code=0) is None
    assert RestartPolicy("never", FakeClock()).delay_after_exit((0, 0), code=1) is None
    assert RestartPolicy("always", FakeClock()).delay_after_exit((0, 0), code=0) == 1


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="on-failure"):
        RestartPolicy("sometimes", FakeClock())

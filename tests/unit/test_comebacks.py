"""Waiting for a replica that is coming back: what a stage's pool knows is on its way
(``Comebacks``, pure, times passed in), and how long a request waits for it (a real
StagePool, on the loop, with short bounds)."""

from __future__ import annotations

import asyncio
import time

import pytest

from omnistage.control.balancing import make_policy
from omnistage.control.replica_table import Transition
from omnistage.dataplane.comebacks import NOTHING_COMING, Comebacks, WaitBounds
from omnistage.dataplane.stage_pool import StagePool
from omnistage.protocol.errors import StageOverloadedError, StageUnavailableError
from omnistage.protocol.messages import Reason, ReplicaState
from tests.unit.fakes import pool_leave, pool_up, replica_entry, ticks, until

BOUNDS = WaitBounds(stage_s=3.0, restart_s=30.0)
STARTED = 100.0


def deadline(c: Comebacks, now: float, bounds: WaitBounds = BOUNDS, queue=(0, 1)) -> float:
    return c.deadline(1, "talker", STARTED, now, bounds, queue)


# -- what is coming (pure) ----------------------------------------------------------------


def test_nothing_coming_waits_the_stage_wait_then_says_so() -> None:
    c = Comebacks()
    assert not c
    assert deadline(c, STARTED) == STARTED + 3
    with pytest.raises(StageUnavailableError) as info:
        deadline(c, STARTED + 3)
    assert str(info.value) == (
        "stage 1 (talker) has no live replica and none is restarting (waited 3.0s)"
    )
    assert NOTHING_COMING in str(info.value)


def test_a_restart_extends_the_wait_to_the_restart_bound_and_names_the_replica() -> None:
    c = Comebacks()
    c.restart(0, at=STARTED + 16)
    assert c
    assert deadline(c, STARTED + 5) == STARTED + 30
    with pytest.raises(StageUnavailableError) as info:
        deadline(c, STARTED + 30)
    assert str(info.value) == (
        "stage 1 (talker) has no live replica: restarting replica 0 did not come up "
        "within 30s (--omni-restart-wait-timeout) (waited 30.0s)"
    )


def test_the_longer_of_the_two_bounds_applies() -> None:
    c = Comebacks()
    c.restart(0, at=STARTED)
    assert deadline(c, STARTED, WaitBounds(stage_s=10.0, restart_s=2.0)) == STARTED + 10


def test_a_restart_due_after_the_bound_fails_at_once() -> None:
    c = Comebacks()
    c.restart(2, at=STARTED + 45)
    with pytest.raises(StageUnavailableError) as info:
        deadline(c, STARTED)
    message = str(info.value)
    assert "replica 2 restarts in 45s, after the 30s a request waits for it" in message
    assert "--omni-restart-wait-timeout" in message


def test_a_starting_registration_is_waited_for_and_leaves_with_its_epoch() -> None:
    c = Comebacks()
    assert c.observe(3, 7, ReplicaState.STARTING)
    assert c and not c.restarting  # never UP: a stage starting, not restarting
    # A transition of another incarnation of the slot does not end this one.
    assert not c.observe(3, 6, ReplicaState.ERROR)
    assert c
    with pytest.raises(StageUnavailableError, match="starting replica 3 did not come up"):
        deadline(c, STARTED + 30)
    assert c.observe(3, 7, ReplicaState.ERROR)  # its start timed out
    assert not c


def test_up_ends_the_restart_of_that_slot_and_marks_the_stage_as_served() -> None:
    c = Comebacks()
    c.observe(0, 1, ReplicaState.STARTING)
    c.observe(0, 1, ReplicaState.UP)
    assert c.was_up and not c
    c.restart(0, at=STARTED + 1)
    assert c.restarting
    assert c.restarts() == {0: STARTED + 1}
    # Relaunched: its new registration loads; the slot still counts once.
    c.observe(0, 2, ReplicaState.STARTING)
    with pytest.raises(StageUnavailableError) as info:
        deadline(c, STARTED + 30)
    assert "no live replica: restarting replica 0 did not come up" in str(info.value)
    assert " and starting" not in str(info.value)
    assert c.observe(0, 2, ReplicaState.UP)
    assert not c and c.restarts() == {}


def test_a_dropped_restart_leaves_nothing_coming() -> None:
    c = Comebacks()
    c.restart(0, at=STARTED + 1)
    c.restart(1, at=STARTED + 2)
    c.restart(0, None)
    assert c.restarts() == {1: STARTED + 2}
    c.restart(1, None)
    assert not c
    with pytest.raises(StageUnavailableError, match="none is restarting"):
        deadline(c, STARTED + 3)


def test_a_full_queue_refuses_a_wait_for_a_comeback_but_not_a_plain_one() -> None:
    c = Comebacks()
    assert deadline(c, STARTED, queue=(5, 5)) == STARTED + 3  # short, as before: no 429
    c.restart(0, at=STARTED + 1)
    with pytest.raises(StageOverloadedError) as info:
        deadline(c, STARTED, queue=(5, 5))
    assert "5 requests already waiting for a replica to come back" in str(info.value)


# -- a request waiting in a real pool -------------------------------------------------------


def pool(max_waiting: int = 1024) -> StagePool:
    return StagePool(1, "talker", make_policy("round-robin"), max_waiting)


async def test_a_request_waits_past_the_stage_wait_for_a_restart_and_gets_the_replica() -> None:
    p = pool()
    pool_up(p, 0)
    pool_leave(p, 0, ReplicaState.ERROR, Reason.PROCESS_EXITED)
    p.restart(0, time.monotonic())
    bounds = WaitBounds(stage_s=0.05, restart_s=5.0)
    waiter = asyncio.create_task(p.wait_live(time.monotonic(), bounds))
    await asyncio.sleep(0.2)  # well past the stage wait
    assert not waiter.done()
    assert p.waiting == 1  # counted: the queue's bound applies
    pool_up(p, 0, epoch=2)
    await asyncio.wait_for(waiter, 1)
    assert p.waiting == 0 and not p.comebacks


async def test_a_restart_given_up_fails_the_waiting_request_promptly() -> None:
    p = pool()
    p.restart(0, time.monotonic() + 1)
    bounds = WaitBounds(stage_s=0.05, restart_s=30.0)
    waiter = asyncio.create_task(p.wait_live(time.monotonic(), bounds))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    started = time.monotonic()
    p.restart(0, None)
    with pytest.raises(StageUnavailableError, match="none is restarting"):
        await asyncio.wait_for(waiter, 1)
    assert time.monotonic() - started < 0.5


async def test_a_starting_replica_that_fails_its_start_ends_the_wait() -> None:
    p = pool()
    e = replica_entry(4, ReplicaState.STARTING, sid=1)
    p.apply(Transition(e, None, ReplicaState.STARTING, Reason.NONE))
    bounds = WaitBounds(stage_s=0.05, restart_s=30.0)
    waiter = asyncio.create_task(p.wait_live(time.monotonic(), bounds))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    e = replica_entry(4, ReplicaState.ERROR, sid=1)
    p.apply(Transition(e, ReplicaState.STARTING, ReplicaState.ERROR, Reason.START_TIMEOUT))
    with pytest.raises(StageUnavailableError, match="none is restarting"):
        await asyncio.wait_for(waiter, 1)


async def test_the_restart_bound_ends_a_wait_that_nothing_answers() -> None:
    p = pool()
    p.restart(0, time.monotonic())
    bounds = WaitBounds(stage_s=0.01, restart_s=0.2)
    started = time.monotonic()
    with pytest.raises(StageUnavailableError, match=r"within 0.2s \(--omni-restart-wait"):
        await p.wait_live(started, bounds)
    assert 0.15 <= time.monotonic() - started < 2


async def test_waits_for_a_comeback_beyond_the_queue_get_429() -> None:
    p = pool(max_waiting=2)
    p.restart(0, time.monotonic())
    bounds = WaitBounds(stage_s=0.01, restart_s=5.0)
    waiters = [asyncio.create_task(p.wait_live(time.monotonic(), bounds)) for _ in range(2)]
    await until(lambda: p.waiting == 2)
    with pytest.raises(StageOverloadedError, match="2 requests already waiting"):
        await p.wait_live(time.monotonic(), bounds)
    pool_up(p, 0)
    await asyncio.wait_for(asyncio.gather(*waiters), 1)


async def test_a_busy_stage_with_a_replica_coming_back_waits_as_long_as_for_it() -> None:
    p = pool()
    pool_up(p, 0, capacity=1)
    pool_up(p, 1, capacity=1)
    assert p.try_acquire("a") is not None and p.try_acquire("b") is not None
    pool_leave(p, 1, ReplicaState.ERROR, Reason.PROCESS_EXITED)  # 0 stays busy
    p.restart(1, time.monotonic())
    bounds = WaitBounds(stage_s=0.05, restart_s=5.0)
    waiter = asyncio.create_task(p.wait_capacity(time.monotonic(), bounds))
    await asyncio.sleep(0.2)
    assert not waiter.done()  # no 429 after the stage wait: the replica is coming
    pool_up(p, 1, capacity=1, epoch=2)
    await asyncio.wait_for(waiter, 1)
    await ticks()
    assert p.try_acquire("next") is not None

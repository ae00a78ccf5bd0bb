"""PrioritySlots: a freed slot goes to the most urgent waiter, the earliest of equals."""

from __future__ import annotations

import asyncio

import pytest

from omnistage.engines.priority_slots import PrioritySlots
from tests.unit.fakes import ticks


async def test_free_slots_are_taken_at_once_and_then_waiters_queue() -> None:
    slots = PrioritySlots(2)
    await slots.acquire()
    await slots.acquire(1)
    waiter = asyncio.ensure_future(slots.acquire())
    await ticks(3)
    assert not waiter.done() and slots.waiting == 1
    slots.release()
    await ticks(2)
    assert waiter.done() and slots.waiting == 0


async def test_a_freed_slot_goes_to_the_most_urgent_then_the_earliest() -> None:
    slots = PrioritySlots(1)
    await slots.acquire()
    got: list[str] = []

    async def take(name: str, priority: int) -> None:
        await slots.acquire(priority)
        got.append(name)

    tasks = [
        asyncio.ensure_future(take(name, priority))
        for name, priority in [("late-1", 1), ("first-a", 0), ("late-2", 1), ("first-b", 0)]
    ]
    await ticks(3)
    for _ in tasks:
        slots.release()
        await ticks(2)
    assert got == ["first-a", "first-b", "late-1", "late-2"]


async def test_a_cancelled_waiter_does_not_lose_a_slot() -> None:
    slots = PrioritySlots(1)
    await slots.acquire()
    gone = asyncio.ensure_future(slots.acquire(0))
    stays = asyncio.ensure_future(slots.acquire(1))
    await ticks(2)
    gone.cancel()
    await ticks(2)
    slots.release()
    await ticks(2)
    assert stays.done() and not stays.cancelled()
    slots.release()
    await slots.acquire()  # the slot came back: taken at once


async def test_a_waiter_cancelled_as_it_is_handed_a_slot_passes_it_on() -> None:
    slots = PrioritySlots(1)
    await slots.acquire()
    first = asyncio.ensure_future(slots.acquire(0))
    second = asyncio.ensure_future(slots.acquire(0))
    await ticks(2)
    slots.release()  # first's future is set ...
    first.cancel()  # ... and its task cancelled before it runs
    await ticks(3)
    assert first.cancelled() and second.done() and not second.cancelled()


def test_at_least_one_slot() -> None:
    with pytest.raises(ValueError):
        PrioritySlots(0)


async def test_a_priority_function_is_read_when_a_slot_frees() -> None:
    slots = PrioritySlots(1)
    await slots.acquire()
    urgency = {"a": 1, "b": 2}
    got: list[str] = []

    async def take(name: str) -> None:
        await slots.acquire(lambda: urgency[name])
        got.append(name)

    tasks = [asyncio.ensure_future(take(name)) for name in ("a", "b")]
    await ticks(3)
    urgency["b"] = 0  # b grew urgent while it waited
    for _ in tasks:
        slots.release()
        await ticks(2)
    assert got == ["b", "a"]

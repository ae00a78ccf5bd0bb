"""The head's own replicas announce their restarts: to the stage's pool, before the
ERROR that would leave it with nothing live and nothing coming; at once after a run that
served; withdrawn when the restart will not happen. A fake launcher, no processes."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from omnistage.config.load import validate_config
from omnistage.control.coordinator import Coordinator
from omnistage.control.replica_table import ReplicaTable, Transition
from omnistage.control.slots import SlotTable
from omnistage.head.local import LocalHooks, LocalReplicas
from omnistage.head.options import HeadOptions
from omnistage.head.state import ControlState
from omnistage.launch.restart import SETTLE_S, RestartPolicy
from omnistage.protocol.messages import ReplicaState
from tests.unit.fakes import FakeClock, ticks


class Process:
    node = None

    def __init__(self, options: Any) -> None:
        self.options = options
        self.pid = 1000 + options.replica_id

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass


class Launcher:
    def __init__(self) -> None:
        self.launched: list[Process] = []

    def launch(self, options: Any) -> Process:
        self.launched.append(Process(options))
        return self.launched[-1]

    def stop_all(self, grace_s: float) -> None:
        pass


class Rig:
    """LocalReplicas over a real coordinator, recording what it tells the loop, in
    order: ("due", replica id, delay from now or None) and ("state", replica id, state)."""

    def __init__(self, policy: str = "on-failure", replicas: int = 1) -> None:
        self.clock = FakeClock()
        self.said: list[tuple[str, int, Any]] = []
        self.loop = asyncio.get_running_loop()
        coordinator = Coordinator(ReplicaTable(self.clock, 5.0), threading.Lock(), self._transition)
        self.coordinator = coordinator
        ids = list(range(replicas))
        slots = SlotTable([0], preallocated={0: replicas}, head_local={0: ids})
        state = ControlState(threading.Lock(), slots, coordinator)
        hooks = LocalHooks(lambda: True, lambda: None, on_restart_due=self._due)
        stage = {"stage_id": 0, "name": "a", "engine": "echo", "final_output": True}
        config = validate_config({"pipeline": "p", "stages": [{**stage, "replicas": replicas}]})
        opts = HeadOptions(config=config, restart_policy=policy)
        self.local = LocalReplicas(opts, state, hooks, master_port=5555, local_key="k")
        self.launcher = Launcher()
        self.local.launcher = self.launcher  # type: ignore[assignment]
        self.local.restarts = RestartPolicy(policy, self.clock)
        self.hurried: list[tuple[int, int]] = []  # (pid, step): the fakes have no threads
        self.local.niced.hurry_load = lambda pid, step: self.hurried.append((pid, step)) is None
        self.local.start(self.loop)
        for rid in ids:
            coordinator.register((0, rid), 1 + rid, "127.0.0.1", True, 60)
            coordinator.ready((0, rid), 1 + rid, 4, 1000)

    def _transition(self, t: Transition) -> None:
        # As the head posts transitions: through the loop, after whatever went before.
        self.loop.call_soon_threadsafe(self.said.append, ("state", t.entry.replica_id, t.new))
        if t.new == ReplicaState.UP:
            self.local.came_up(t.entry.key)

    def _due(self, stage_id: int, replica_id: int, at: float | None) -> None:
        delay = None if at is None else round(at - self.loop.time(), 0)
        self.said.append(("due", replica_id, delay))

    @classmethod
    async def serving(cls, policy: str = "on-failure", replicas: int = 1) -> Rig:
        """Its replicas UP, and what that said already heard."""
        rig = cls(policy, replicas)
        await ticks()
        rig.said.clear()
        return rig

    async def exit(self, code: int = -9, replica_id: int | None = None) -> None:
        await asyncio.to_thread(
            self.local._on_exit, self._proc(replica_id), code
        )  # a launcher thread
        await ticks()

    async def dying(self, replica_id: int | None = None) -> None:
        """The launcher saw it killed, its process still exiting (launch.death_watch)."""
        await asyncio.to_thread(self.local._on_dying, self._proc(replica_id))
        await ticks()

    def _proc(self, replica_id: int | None) -> Process:
        if replica_id is None:
            return self.launcher.launched[-1]
        return next(p for p in self.launcher.launched if p.options.replica_id == replica_id)


async def test_a_replica_that_served_is_announced_restarting_at_once_before_its_error() -> None:
    rig = await Rig.serving()
    rig.clock.now += SETTLE_S + 5
    await rig.exit()
    assert rig.said == [("due", 0, 0), ("state", 0, ReplicaState.ERROR)]
    await asyncio.sleep(0.05)
    assert len(rig.launcher.launched) == 2  # relaunched at once


async def test_a_replica_seen_killed_fails_at_once_and_restarts_only_once_its_process_is_gone() -> (
    None
):
    rig = await Rig.serving()
    rig.clock.now += SETTLE_S + 5
    await rig.dying()
    assert rig.said == [("due", 0, 0), ("state", 0, ReplicaState.ERROR)]
    entry = next(e for e in rig.coordinator.snapshot() if e.replica_id == 0)
    assert entry.why == "local process exited (killed, still exiting)"
    await asyncio.sleep(0.05)
    assert len(rig.launcher.launched) == 1  # the dying process still holds its memory
    await rig.exit()
    assert rig.said == [("due", 0, 0), ("state", 0, ReplicaState.ERROR)]  # said once
    await asyncio.sleep(0.05)
    assert len(rig.launcher.launched) == 2  # relaunched at once after the exit


async def test_a_replica_failing_soon_after_up_is_announced_with_its_backoff() -> None:
    rig = await Rig.serving()
    rig.clock.now += 2
    await rig.exit()
    assert rig.said == [("due", 0, 1), ("state", 0, ReplicaState.ERROR)]
    assert len(rig.launcher.launched) == 1  # not yet: it is due in a second


async def test_no_restart_is_announced_as_none_coming() -> None:
    rig = await Rig.serving("never")
    await rig.exit()
    assert rig.said == [("state", 0, ReplicaState.ERROR), ("due", 0, None)]


async def test_a_slot_retired_while_waiting_for_its_restart_withdraws_it() -> None:
    rig = await Rig.serving()
    await rig.exit()
    rig.said.clear()
    assert rig.local.retire(0, 0, None)
    await ticks()
    assert rig.said == [("due", 0, None)]


async def test_a_restart_its_stage_waits_on_loads_at_full_priority_else_niced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMNISTAGE_LOAD_NICE", "7")
    rig = await Rig.serving(replicas=2)
    assert [p.options.load_nice for p in rig.launcher.launched] == [0, 0]  # first starts
    rig.clock.now += SETTLE_S + 5
    await rig.exit(replica_id=1)  # replica 0 still serves: the restart loads niced
    await asyncio.sleep(0.05)
    assert rig.launcher.launched[-1].options.load_nice == 7  # OMNISTAGE_LOAD_NICE
    await rig.exit(replica_id=0)  # replica 1's restart is not UP yet: nothing serves
    await asyncio.sleep(0.05)
    restarted = rig.launcher.launched[-1].options
    assert (restarted.replica_id, restarted.load_nice) == (0, 0)


async def test_a_niced_restart_loads_at_full_priority_once_its_stage_has_no_live_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMNISTAGE_LOAD_NICE", "7")
    monkeypatch.setenv("OMNISTAGE_LOAD_NICE_S", "60")
    rig = await Rig.serving(replicas=2)
    rig.clock.now += SETTLE_S + 5
    await rig.exit(replica_id=1)
    await asyncio.sleep(0.05)
    loading = rig.launcher.launched[-1]
    assert loading.options.load_nice == 7 and rig.hurried == []
    await rig.exit(replica_id=0)  # the last live one: the stage waits on replica 1 now
    assert rig.hurried == [(loading.pid, 7)]


async def test_a_niced_restart_loads_niced_for_load_nice_s_at_most_unless_up_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMNISTAGE_LOAD_NICE_S", "0.1")
    rig = await Rig.serving(replicas=3)
    rig.clock.now += SETTLE_S + 5
    await rig.exit(replica_id=1)
    await rig.exit(replica_id=2)  # both restarts load niced beside replica 0
    await asyncio.sleep(0.02)
    rig.coordinator.register((0, 2), 10, "127.0.0.1", True, 60)
    rig.coordinator.ready((0, 2), 10, 4, 1000)  # replica 2 is UP before its time is up
    await asyncio.sleep(0.2)
    assert rig.hurried == [(1001, 10)]  # replica 1, still loading: OMNISTAGE_LOAD_NICE's 10

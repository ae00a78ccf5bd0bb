"""Autoscaling: the pure policy with a fake clock, the choice of replica to remove, the
scaler's tick over fakes, head-local id reservation, and the config checks."""

from __future__ import annotations

import asyncio
import copy
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from omnistage.api.app import create_app
from omnistage.config.load import validate_config
from omnistage.config.schema import AutoscalingConfig
from omnistage.control.autoscale import AutoscalePolicy, Candidate, Direction, pick_victim
from omnistage.control.balancing import make_policy
from omnistage.control.coordinator import Coordinator
from omnistage.control.replica_table import ReplicaEntry, ReplicaTable, Transition
from omnistage.control.slots import SlotTable
from omnistage.dataplane.latency import LatencySnapshot
from omnistage.dataplane.stage_pool import ReplicaHandle, StagePool
from omnistage.head.local import LocalHooks, LocalReplicas
from omnistage.head.options import HeadOptions
from omnistage.head.scaler import Scaler
from omnistage.head.state import ControlState
from omnistage.launch.restart import RestartPolicy
from omnistage.protocol.errors import ConfigError
from omnistage.protocol.messages import ReplicaState
from omnistage.protocol.registration import RegisterRequest
from omnistage.service import RequestCounts
from tests.unit.fakes import FakeClock


def _policy(clock: FakeClock, **kw: Any) -> AutoscalePolicy:
    spec = {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_inflight_per_replica": 2,
        "upscale_delay_s": 3,
        "downscale_delay_s": 10,
        **kw,
    }
    return AutoscalePolicy(AutoscalingConfig(**spec), clock)


# -- the policy ------------------------------------------------------------------------


def test_scales_up_straight_to_desired_only_after_the_upscale_delay() -> None:
    clock = FakeClock()
    policy = _policy(clock)
    assert policy.decide(1, 7).direction is Direction.HOLD  # wants 4, waits
    clock.now += 2.9
    assert policy.decide(1, 7).direction is Direction.HOLD
    clock.now += 0.1
    d = policy.decide(1, 7)
    assert (d.direction, d.current, d.replicas, d.desired, d.delta) == (Direction.UP, 1, 4, 4, 3)
    assert "upscale_delay_s 3" in d.reason and "load 7" in d.reason


def test_one_quiet_tick_restarts_the_upscale_clock() -> None:
    clock = FakeClock()
    policy = _policy(clock)
    policy.decide(1, 5)
    clock.now += 2
    assert policy.decide(1, 2).direction is Direction.HOLD  # within target: clock resets
    clock.now += 2
    assert policy.decide(1, 5).direction is Direction.HOLD
    clock.now += 2.5
    assert policy.decide(1, 5).direction is Direction.HOLD  # 2.5 s since it rose again
    clock.now += 0.5
    assert policy.decide(1, 5).direction is Direction.UP


def test_load_at_capacity_holds() -> None:
    clock = FakeClock()
    policy = _policy(clock, upscale_delay_s=0, downscale_delay_s=0)
    assert policy.decide(2, 4).direction is Direction.HOLD  # exactly 2 x 2
    assert policy.decide(2, 3).direction is Direction.HOLD  # ceil(3 / 2) == 2


def test_scales_down_one_replica_per_downscale_delay() -> None:
    clock = FakeClock()
    policy = _policy(clock)
    assert policy.decide(4, 0).direction is Direction.HOLD
    clock.now += 10
    d = policy.decide(4, 0)
    assert (d.direction, d.replicas, d.desired) == (Direction.DOWN, 3, 1)
    # The next step waits a whole delay again, and load in between restarts the clock.
    clock.now += 9.9
    assert policy.decide(3, 0).direction is Direction.HOLD
    clock.now += 0.1
    assert policy.decide(3, 0).replicas == 2
    clock.now += 5
    assert policy.decide(2, 4).direction is Direction.HOLD  # 4 fills 2 x 2
    clock.now += 5
    assert policy.decide(2, 0).direction is Direction.HOLD
    clock.now += 10
    assert policy.decide(2, 0).replicas == 1


def test_no_flapping_when_load_hovers_around_a_boundary() -> None:
    clock = FakeClock()
    policy = _policy(clock)
    # Load alternates between needing 2 and 3 replicas with 2 running, every second:
    # never 3 s above, so nothing changes.
    for i in range(60):
        d = policy.decide(2, 5 if i % 2 else 4)
        assert d.direction is Direction.HOLD
        clock.now += 1


def test_desired_is_clamped_to_min_and_max() -> None:
    clock = FakeClock()
    policy = _policy(clock, min_replicas=2, max_replicas=3, upscale_delay_s=0)
    assert policy.desired(0) == 2
    assert policy.desired(100) == 3
    d = policy.decide(2, 100)
    assert (d.direction, d.replicas) == (Direction.UP, 3)
    assert policy.decide(3, 100).direction is Direction.HOLD  # at max


def test_below_min_or_above_max_is_corrected_at_once() -> None:
    clock = FakeClock()
    policy = _policy(clock, min_replicas=2, max_replicas=3)
    d = policy.decide(1, 0)
    assert (d.direction, d.replicas) == (Direction.UP, 2)
    assert "min_replicas" in d.reason
    d = policy.decide(5, 100)
    assert (d.direction, d.replicas) == (Direction.DOWN, 4)


def test_starting_replicas_count_so_a_slow_start_does_not_launch_again() -> None:
    clock = FakeClock()
    policy = _policy(clock, upscale_delay_s=0)
    assert policy.decide(1, 8).replicas == 4
    # The scaler now counts the three new replicas (still loading): the same load holds.
    for _ in range(10):
        clock.now += 1
        assert policy.decide(4, 8).direction is Direction.HOLD


def test_fractional_target() -> None:
    policy = _policy(FakeClock(), target_inflight_per_replica=1.5, max_replicas=10)
    assert [policy.desired(n) for n in (0, 1, 2, 3, 4)] == [1, 1, 2, 2, 3]


# -- which replica goes ------------------------------------------------------------------


def test_victim_prefers_not_serving_then_least_loaded_then_highest_id() -> None:
    assert pick_victim([]) is None
    assert pick_victim([Candidate(0, True, 0), Candidate(3, False, 0)]) == 3
    assert pick_victim([Candidate(0, True, 1), Candidate(1, True, 4)]) == 0
    assert pick_victim([Candidate(0, True, 2), Candidate(1, True, 2), Candidate(2, True, 2)]) == 2


# -- head-local id reservation --------------------------------------------------------


def test_reserve_local_takes_the_lowest_free_id_and_keeps_it_from_auto_assign() -> None:
    slots = SlotTable([0], preallocated={0: 1}, head_local={0: [0]})
    assert slots.reserve_local(0, taken={0}) == 1
    slot = slots.get(0, 1)
    assert slot is not None and slot.head_local
    # A headless replica is not given the reserved id.
    assert slots.register(RegisterRequest(stage_id=0, replica_id=-1)).replica_id == 2
    assert slots.reserve_local(0, taken={0, 1}) == 3  # 2 is a headless replica's
    # Retired and released: the id is free for auto-assignment again.
    s1 = slots.register(RegisterRequest(stage_id=0, replica_id=1))
    slots.unreserve(0, 1)
    slots.release(0, 1, s1.epoch)
    assert slots.register(RegisterRequest(stage_id=0, replica_id=-1)).replica_id == 1


def test_reserve_local_reuses_a_head_local_slot_the_head_no_longer_runs() -> None:
    slots = SlotTable([0], preallocated={0: 2}, head_local={0: [0, 1]})
    slots.register(RegisterRequest(stage_id=0, replica_id=1))  # filled, then it died
    assert slots.reserve_local(0, taken={0}) == 1


# -- the scaler's tick -------------------------------------------------------------------


class FakeReplicas:
    def __init__(self, owned: set[int]) -> None:
        self.mine = set(owned)
        self.gone: set[int] = set()
        self.retired: list[tuple[int, int | None]] = []

    def owned(self, stage_id: int) -> list[int]:
        return sorted(self.mine)

    def retiring(self, stage_id: int) -> list[int]:
        return sorted(self.gone)

    def add(self, stage_id: int) -> int | None:
        rid = next(i for i in range(100) if i not in self.mine | self.gone)
        self.mine.add(rid)
        return rid

    def retire(self, stage_id: int, replica_id: int, epoch: int | None) -> bool:
        self.mine.discard(replica_id)
        self.gone.add(replica_id)
        self.retired.append((replica_id, epoch))
        return True


def _entry(rid: int, state: ReplicaState, epoch: int = 1) -> ReplicaEntry:
    return ReplicaEntry(0, rid, epoch, state, "127.0.0.1", True, 0.0, 0.0, 0.0)


def _config(**scaling: Any) -> Any:
    spec = {"max_replicas": 3, "target_inflight_per_replica": 2, **scaling}
    stages = [
        {"stage_id": 0, "name": "a", "engine": "echo", "autoscaling": spec},
        {"stage_id": 1, "name": "b", "engine": "echo", "inputs": [0], "final_output": True},
    ]
    return validate_config({"pipeline": "p", "stages": stages})


def _pool_with(in_flight: dict[int, int], epoch: int = 1) -> StagePool:
    pool = StagePool(0, "a", make_policy("round-robin"))
    for rid, n in in_flight.items():
        pool.replicas[rid] = ReplicaHandle(0, rid, epoch, b"x", 10, in_flight=n)
    return pool


def test_scaler_adds_replicas_on_load_and_drains_the_least_loaded_when_it_ends() -> None:
    clock, wall = FakeClock(), FakeClock()
    config = _config(upscale_delay_s=0, downscale_delay_s=5)
    pools = {0: _pool_with({0: 5}), 1: _pool_with({})}
    entries = [_entry(0, ReplicaState.UP)]
    replicas = FakeReplicas({0})
    scaler = Scaler(config, {0, 1}, pools, lambda: entries, replicas, clock=clock, wall=wall)
    assert set(scaler.stages) == {0}  # stage 1 has no autoscaling
    [d] = scaler.tick()
    assert (d.direction, d.current, d.replicas) == (Direction.UP, 1, 3)
    assert replicas.mine == {0, 1, 2}
    view = scaler.status()[0]
    assert view["decisions"] == {"up": 1, "down": 0}
    assert view["last_decision"]["replica_ids"] == [1, 2]
    assert view["desired"] == 3 and view["active"] is True

    # Still loading: counted, so the same load launches nothing more.
    entries = [_entry(0, ReplicaState.UP), _entry(1, ReplicaState.STARTING)]
    assert scaler.tick() == []

    # Load gone; all three UP, replica 2 still holds one request.
    entries = [_entry(r, ReplicaState.UP) for r in (0, 1, 2)]
    pools[0] = _pool_with({0: 0, 1: 0, 2: 1})
    scaler._pools = pools
    assert scaler.tick() == []  # below, but not for 5 s yet
    clock.now += 5
    [d] = scaler.tick()
    assert d.direction is Direction.DOWN and replicas.retired == [(1, 1)]
    entries[1] = _entry(1, ReplicaState.DRAINING)
    clock.now += 4
    assert scaler.tick() == []
    clock.now += 1
    scaler.tick()
    assert replicas.retired == [(1, 1), (0, 1)]  # 2 still works on a request
    entries[0] = _entry(0, ReplicaState.DRAINING)
    clock.now += 50
    assert scaler.tick() == []  # at min_replicas
    assert scaler.status()[0]["decisions"] == {"up": 1, "down": 2}


def test_scaler_counts_headless_replicas_but_removes_only_its_own() -> None:
    clock = FakeClock()
    config = _config(upscale_delay_s=0, downscale_delay_s=0)
    pools = {0: _pool_with({0: 0, 5: 0}), 1: _pool_with({})}
    entries = [_entry(0, ReplicaState.UP), _entry(5, ReplicaState.UP)]  # 5: headless
    replicas = FakeReplicas({0})
    scaler = Scaler(config, {0}, pools, lambda: entries, replicas, clock=clock)
    [d] = scaler.tick()  # wants 1 and has 2: the headless one carries the stage alone
    assert d.direction is Direction.DOWN and replicas.retired == [(0, 1)]
    entries[0] = _entry(0, ReplicaState.DRAINING)
    clock.now += 10
    assert scaler.tick() == []
    assert scaler.status()[0]["replicas"] == 1
    # The headless replica leaves: below min_replicas, one of the head's own comes at once.
    entries[1] = _entry(5, ReplicaState.DOWN)
    [d] = scaler.tick()
    assert d.direction is Direction.UP and replicas.mine == {1}


def test_scaler_ignores_stages_this_head_does_not_launch() -> None:
    config = _config()
    scaler = Scaler(config, {1}, {}, list, FakeReplicas(set()))
    assert scaler.stages == {}
    assert scaler.status()[0]["active"] is False


def test_metrics_count_decisions_and_gauge_desired_replicas() -> None:
    clock = FakeClock()
    config = _config(upscale_delay_s=0)
    pools = {0: _pool_with({0: 6}), 1: _pool_with({})}
    replicas = FakeReplicas({0})
    entries = [_entry(0, ReplicaState.UP)]
    scaler = Scaler(config, {0}, pools, lambda: entries, replicas, clock=clock)
    scaler.tick()
    stages = [{"stage_id": sid, "autoscaling": v} for sid, v in scaler.status().items()]
    head = SimpleNamespace(
        config=config,
        request_counts=lambda: RequestCounts(0, 0, 0),
        replica_entries=list,
        replica_loads=list,
        stages_status=lambda: {"stages": [*stages, {"stage_id": 1, "autoscaling": None}]},
        stage_waiting=dict,
        response_counts=lambda mine: mine,
        realtime=lambda mine: mine,
        latency=LatencySnapshot,
    )
    with TestClient(create_app(head)) as client:
        text = client.get("/metrics").text
    labels = 'stage_id="0",stage="a"'
    up, down = 'direction="up",cause="inflight"', 'direction="down",cause="inflight"'
    assert f"omnistage_autoscale_decisions_total{{{labels},{up}}} 1" in text
    assert f"omnistage_autoscale_decisions_total{{{labels},{down}}} 0" in text
    assert f"omnistage_autoscale_desired_replicas{{{labels}}} 3" in text
    assert f"omnistage_autoscale_replicas{{{labels}}} 1" in text
    assert f"omnistage_autoscale_load{{{labels}}} 6" in text
    scaled = [line for line in text.splitlines() if line.startswith("omnistage_autoscale_")]
    assert scaled and not [line for line in scaled if 'stage="b"' in line]


# -- config ------------------------------------------------------------------------------

BASE: dict[str, Any] = {
    "pipeline": "p",
    "stages": [{"stage_id": 0, "name": "a", "engine": "echo", "final_output": True}],
}


def _load(scaling: dict[str, Any], **stage: Any) -> Any:
    raw = copy.deepcopy(BASE)
    raw["stages"][0].update(autoscaling=scaling, **stage)
    return validate_config(raw, "x.yaml").stages[0]


def test_config_defaults_and_starting_count() -> None:
    s = _load({"max_replicas": 3})
    assert s.replicas == 1 and s.autoscaling is not None
    assert s.autoscaling.model_dump() == {
        "min_replicas": 1,
        "max_replicas": 3,
        "target_inflight_per_replica": 4.0,
        "upscale_delay_s": 5.0,
        "downscale_delay_s": 30.0,
        "target_p90_first_token_s": None,
        "target_p90_first_audio_s": None,
        "target_p90_queue_wait_s": None,
        "latency_window_s": 30.0,
        "latency_min_samples": 20,
        "busy_fraction": 0.8,
    }
    assert _load({"min_replicas": 2, "max_replicas": 3}).replicas == 2  # starts at min
    assert _load({"max_replicas": 3}, replicas=3).replicas == 3


@pytest.mark.parametrize(
    ("scaling", "stage", "where"),
    [
        ({"min_replicas": 3, "max_replicas": 2}, {}, "stages[0].autoscaling.max_replicas"),
        ({"min_replicas": 0, "max_replicas": 2}, {}, "stages[0].autoscaling.min_replicas"),
        ({"max_replicas": 2, "target_inflight_per_replica": 0}, {}, "stages[0].autoscaling.target"),
        ({"max_replicas": 2, "upscale_delay_s": -1}, {}, "stages[0].autoscaling.upscale"),
        ({"min_replicas": 1}, {}, "stages[0].autoscaling.max_replicas"),
        ({"max_replicas": 2, "cooldown": 1}, {}, "stages[0].autoscaling.cooldown"),
        ({"max_replicas": 2}, {"replicas": 3}, "stages[0].replicas"),
        ({"max_replicas": 2}, {"replicas": 0}, "stages[0].replicas"),
    ],
)
def test_config_errors_name_the_yaml_path(
    scaling: dict[str, Any], stage: dict[str, Any], where: str
) -> None:
    with pytest.raises(
        ConfigError, match=r"x\.yaml: " + where.replace("[", r"\[").replace("]", r"\]")
    ):
        _load(scaling, **stage)


# -- the head's own replicas: add and retire (a fake launcher) ---------------------------


class FakeProcess:
    node = None

    def __init__(self, options: Any, on_exit: Any) -> None:
        self.options, self._on_exit = options, on_exit
        self.pid = 1000 + options.replica_id
        self.terminated = self.killed = False

    def terminate(self) -> None:
        self.terminated = True
        self._on_exit(self, 0)  # drains at once and exits cleanly

    def kill(self) -> None:
        self.killed = True


class FakeLauncher:
    def __init__(self, on_exit: Any) -> None:
        self.on_exit = on_exit
        self.launched: list[FakeProcess] = []

    def launch(self, options: Any) -> FakeProcess:
        proc = FakeProcess(options, self.on_exit)
        self.launched.append(proc)
        return proc

    def stop_all(self, grace_s: float) -> None:
        pass


def test_added_replicas_take_free_ids_and_retired_ones_are_drained_not_restarted() -> None:
    config = _config()
    opts = HeadOptions(config=config, restart_policy="always")
    transitions: list[Transition] = []
    coordinator = Coordinator(ReplicaTable(FakeClock(), 5.0), threading.Lock(), transitions.append)
    slots = SlotTable([0, 1], preallocated={0: 1, 1: 1}, head_local={0: [0], 1: [0]})
    state = ControlState(threading.Lock(), slots, coordinator)
    hooks = LocalHooks(is_serving=lambda: True, fail_head=lambda: None)
    local = LocalReplicas(opts, state, hooks, master_port=5555, local_key="key")
    launcher = FakeLauncher(local._on_exit)
    local.launcher = launcher
    local.restarts = RestartPolicy("always", FakeClock(), base_delay_s=0.01)

    async def scenario() -> None:
        local.start(asyncio.get_running_loop())
        assert local.owned(0) == [0]
        assert local.add(0) == 1 and local.add(0) == 2
        assert local.owned(0) == [0, 1, 2]
        s2 = slots.get(0, 2)
        assert s2 is not None and s2.head_local
        # Replica 2 serves (registered, READY); replica 1 is still loading.
        slot = slots.register(RegisterRequest(stage_id=0, replica_id=2, local_key="key"))
        coordinator.register((0, 2), slot.epoch, "127.0.0.1", True, 60)
        coordinator.ready((0, 2), slot.epoch, 4, 1002)
        assert local.retire(0, 2, slot.epoch)
        assert local.retiring(0) == [2] and local.owned(0) == [0, 1]
        assert transitions[-1].new is ReplicaState.DRAINING  # the head stops routing first
        assert not launcher.launched[-1].terminated
        await asyncio.sleep(0.4)  # then it is asked to drain, and exits 0
        assert launcher.launched[-1].terminated
        assert transitions[-1].new is ReplicaState.DOWN
        assert local.retiring(0) == [] and not slots.get(0, 2).head_local  # type: ignore[union-attr]
        # A loading replica just stops.
        assert local.retire(0, 1, None)
        await asyncio.sleep(0.1)  # "always" would have restarted them by now
        assert launcher.launched[2].terminated
        assert len(launcher.launched) == 4 and local.owned(0) == [0]
        assert not local.retire(0, 1, None)  # not the head's any more
        # The next replica takes the lowest free id again.
        assert local.add(0) == 1

    asyncio.run(scenario())


def test_jobs_queued_in_the_store_count_as_waiting_load() -> None:
    # One replica with 2 requests in flight (its target): no reason to scale, until 4
    # jobs wait in the store for the stage.
    config = _config(upscale_delay_s=0)
    pools = {0: _pool_with({0: 2}), 1: _pool_with({})}
    entries = [_entry(0, ReplicaState.UP)]
    backlog = {0: 0}
    replicas = FakeReplicas({0})
    scaler = Scaler(
        config, {0}, pools, lambda: entries, replicas, clock=FakeClock(), backlog=backlog.get
    )
    assert scaler.tick() == []
    backlog[0] = 4
    [d] = scaler.tick()
    assert (d.direction, d.load, d.replicas) == (Direction.UP, 6, 3)

"""Latency-target autoscaling: the sliding window, the policy with a fake clock, the
recorder feeding the windows through a real orchestrator, the scaler's status and
metrics in latency mode, and the config checks."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from omnistage.api.app import create_app
from omnistage.config.load import validate_config
from omnistage.config.schema import AutoscalingConfig
from omnistage.control.autoscale import Cause, Direction, StageLoad
from omnistage.control.latency_autoscale import LatencyPolicy
from omnistage.control.latency_window import LatencyWindow
from omnistage.dataplane.latency import LatencyRecorder, LatencySnapshot
from omnistage.head.scaler import Scaler
from omnistage.protocol.errors import ConfigError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ReplicaState
from omnistage.service import RequestCounts
from tests.unit.fakes import FakeClock
from tests.unit.test_autoscale import FakeReplicas, _entry, _pool_with
from tests.unit.test_orchestrator_retry import PROMPT, Head, collect

# -- the window --------------------------------------------------------------------------


def test_window_p90_is_the_nearest_rank_and_one_outlier_in_ten_does_not_set_it() -> None:
    w = LatencyWindow(10.0)
    assert w.stats(0.0).samples == 0 and w.stats(0.0).p90 is None
    for i in range(9):
        w.observe(1.0, 0.0, 0.1 * (i + 1))  # 0.1 .. 0.9
    w.observe(1.0, 0.0, 30.0)
    s = w.stats(1.0)
    assert (s.samples, s.p90) == (10, pytest.approx(0.9))
    w.observe(1.0, 0.0, 31.0)  # two outliers in eleven: the p90 is one
    assert w.stats(1.0).p90 == 30.0


def test_window_forgets_samples_older_than_its_length_and_is_bounded() -> None:
    w = LatencyWindow(5.0, max_samples=3)
    w.observe(0.0, 0.0, 9.0)
    w.observe(4.0, 3.0, 1.0)
    assert w.stats(5.0).samples == 2
    assert w.stats(5.5).samples == 1  # the first expired (observed at 0, 5 s ago)
    for v in (2.0, 3.0, 4.0):
        w.observe(6.0, 6.0, v)
    assert len(w) == 3 and w.stats(6.0).p90 == 4.0  # the oldest went first


def test_window_since_counts_only_requests_that_began_after_it() -> None:
    w = LatencyWindow(60.0)
    w.observe(10.0, 2.0, 8.0)  # queued before the change, finished after it
    w.observe(11.0, 10.5, 0.5)
    s = w.stats(12.0, since=10.0)
    assert (s.samples, s.p90) == (1, 0.5)


# -- the policy --------------------------------------------------------------------------


def _spec(**kw: Any) -> AutoscalingConfig:
    return AutoscalingConfig(
        **{
            "min_replicas": 1,
            "max_replicas": 4,
            "target_p90_first_token_s": 1.0,
            "latency_window_s": 20,
            "latency_min_samples": 10,
            "upscale_delay_s": 2,
            "downscale_delay_s": 10,
            **kw,
        }
    )


class Stage:
    """A policy over one first-token window, and a way to feed it requests."""

    def __init__(self, **kw: Any) -> None:
        self.clock = FakeClock(100.0)
        self.window = LatencyWindow(_spec(**kw).latency_window_s)
        self.policy = LatencyPolicy(_spec(**kw), self.clock, {"first_token": self.window})

    def requests(self, *latencies: float) -> None:
        """Requests that began now - latency and had their first token now."""
        now = self.clock.now
        for v in latencies:
            self.window.observe(now, now - v, v)

    def step(self, current: int, **load: int) -> Any:
        return self.policy.step(current, StageLoad(**load))


# Two replicas of capacity 4, both full, 6 more waiting; and the same, quiet.
BUSY = {"in_flight": 8, "waiting": 6, "capacity": 8, "serving": 2}
QUIET = {"in_flight": 1, "capacity": 8, "serving": 2}


def test_a_load_step_that_misses_the_target_scales_up_after_the_delay() -> None:
    st = Stage()
    st.requests(*[0.2] * 10)
    assert st.step(2, **BUSY).cause is Cause.WITHIN  # fast so far
    st.clock.now += 1
    st.requests(*[2.5] * 10)  # the step: half the window is slow now
    d = st.step(2, **BUSY)
    assert (d.direction, d.cause) == (Direction.HOLD, Cause.DELAY)
    st.clock.now += 1.9
    assert st.step(2, **BUSY).direction is Direction.HOLD
    st.clock.now += 0.1
    d = st.step(2, **BUSY)
    # 14 requests on replicas of 4 want 4 (and 2 x 2.5 s / 1 s = 5, capped at double: 4).
    assert (d.direction, d.cause, d.current, d.replicas) == (Direction.UP, Cause.LATENCY, 2, 4)
    assert "p90 first_token 2.500s over target 1s (20 samples)" in d.reason
    assert "6 waiting for a replica slot" in d.reason and "upscale_delay_s 2" in d.reason


def test_one_slow_request_among_fast_ones_does_not_scale() -> None:
    st = Stage(upscale_delay_s=0)
    st.requests(30.0)  # alone: too few samples to call it a miss
    d = st.step(2, **BUSY)
    assert (d.direction, d.cause) == (Direction.HOLD, Cause.FEW_SAMPLES)
    assert "1 of latency_min_samples 10" in d.reason
    st.requests(*[0.3] * 12)  # one in thirteen: the p90 is a fast one
    for _ in range(20):
        st.clock.now += 0.25
        assert st.step(2, **BUSY).direction is Direction.HOLD


def test_a_missed_target_with_idle_replicas_is_not_blamed_on_load() -> None:
    st = Stage(upscale_delay_s=0)
    st.requests(*[3.0] * 20)
    d = st.step(2, **QUIET)
    assert (d.direction, d.cause) == (Direction.HOLD, Cause.NOT_LOAD)
    assert "not busy (1 in flight of capacity 8" in d.reason
    # Busy by in-flight share alone (7 of 8 >= 0.8), nothing waiting: load is the cause.
    d = st.step(2, in_flight=7, capacity=8, serving=2)
    assert (d.direction, d.replicas) == (Direction.UP, 4)  # 3 s over 1 s: double
    # Queued inside the replicas counts as waiting.
    st2 = Stage(upscale_delay_s=0)
    st2.requests(*[3.0] * 20)
    assert st2.step(2, in_flight=2, queued=1, capacity=8, serving=2).direction is Direction.UP


def test_the_upscale_waits_for_the_new_replicas_and_then_for_fresh_samples() -> None:
    st = Stage(upscale_delay_s=0)
    st.requests(*[2.0] * 20)
    assert st.step(2, **BUSY).replicas == 4
    # The new ones load: the slow window is not read again meanwhile.
    for _ in range(8):
        st.clock.now += 0.5
        d = st.step(4, **{**BUSY, "serving": 2})
        assert (d.direction, d.cause) == (Direction.HOLD, Cause.STARTING)
    # All four serve. Requests that queued before (and finish slow now) do not count.
    st.clock.now += 0.5
    assert st.step(4, in_flight=14, capacity=16, serving=4).direction is Direction.HOLD
    now = st.clock.now
    st.window.observe(now + 0.1, now - 3.0, 3.1)
    st.clock.now += 0.5
    d = st.step(4, in_flight=14, capacity=16, serving=4)
    assert d.cause is Cause.FEW_SAMPLES and st.policy.reads["first_token"].samples == 0


def test_at_max_replicas_a_miss_under_load_holds_and_says_so() -> None:
    st = Stage(upscale_delay_s=0, max_replicas=2)
    st.requests(*[2.0] * 20)
    d = st.step(2, **BUSY)
    assert (d.direction, d.cause) == (Direction.HOLD, Cause.AT_MAX)
    assert "at max_replicas 2" in d.reason


def test_headroom_scales_down_one_replica_at_a_time_on_fresh_samples() -> None:
    st = Stage()
    light = {"in_flight": 2, "capacity": 16, "serving": 4}
    st.requests(*[0.2] * 20)
    assert st.step(4, **light).cause is Cause.DELAY  # headroom, waiting out the delay
    st.clock.now += 10
    d = st.step(4, **light)
    assert (d.direction, d.cause, d.replicas) == (Direction.DOWN, Cause.HEADROOM, 3)
    assert "under 0.5 x target 1s" in d.reason and "fits 3 replica(s)" in d.reason
    # The next step needs samples from after this one, for a whole delay again.
    light = {"in_flight": 2, "capacity": 12, "serving": 3}
    st.clock.now += 1
    d = st.step(3, **light)
    assert (d.direction, d.cause) == (Direction.HOLD, Cause.FEW_SAMPLES)
    st.requests(0.3, 0.2)
    assert st.step(3, **light).cause is Cause.DELAY
    st.clock.now += 9.9
    assert st.step(3, **light).direction is Direction.HOLD
    st.clock.now += 0.1
    assert st.step(3, **light).replicas == 2


def test_no_headroom_when_the_p90_is_near_target_or_the_load_would_not_fit() -> None:
    st = Stage(downscale_delay_s=0)
    st.requests(*[0.6] * 20)  # under target, but not under half of it
    assert st.step(4, in_flight=1, capacity=16, serving=4).direction is Direction.HOLD
    st = Stage(downscale_delay_s=0)
    st.requests(*[0.2] * 20)
    # 10 in flight: 3 replicas of 4 at busy_fraction 0.8 take 9.6.
    d = st.step(4, in_flight=10, capacity=16, serving=4)
    assert (d.direction, d.cause) == (Direction.HOLD, Cause.WITHIN)
    assert "does not fit 3 replica(s)" in d.reason
    assert st.step(4, in_flight=2, waiting=1, capacity=16, serving=4).direction is Direction.HOLD
    assert st.step(4, in_flight=9, capacity=16, serving=4).direction is Direction.DOWN


def test_no_samples_holds_and_an_idle_stage_steps_down() -> None:
    st = Stage(upscale_delay_s=0, downscale_delay_s=5)
    for _ in range(40):  # in flight but nothing timed yet (long first tokens)
        d = st.step(3, in_flight=12, waiting=5, capacity=12, serving=3)
        assert (d.direction, d.cause) == (Direction.HOLD, Cause.FEW_SAMPLES)
        st.clock.now += 0.5
    # No load and no samples: idle, one replica per downscale delay down to the minimum.
    assert st.step(3, capacity=12, serving=3).cause is Cause.DELAY
    st.clock.now += 5
    d = st.step(3, capacity=12, serving=3)
    assert (d.direction, d.cause, d.replicas) == (Direction.DOWN, Cause.IDLE, 2)
    st.clock.now += 5
    assert st.step(2, capacity=8, serving=2).replicas == 1
    st.clock.now += 50
    assert st.step(1, capacity=4, serving=1).direction is Direction.HOLD


def test_bounds_are_enforced_at_once_in_latency_mode_too() -> None:
    st = Stage(min_replicas=2)
    d = st.step(1, capacity=4, serving=1)
    assert (d.direction, d.replicas, d.cause) == (Direction.UP, 2, Cause.MIN_REPLICAS)
    d = st.step(6, capacity=24, serving=6)
    assert (d.direction, d.replicas, d.cause) == (Direction.DOWN, 5, Cause.MAX_REPLICAS)


def test_the_upscale_takes_enough_replicas_for_the_waiting_load() -> None:
    st = Stage(upscale_delay_s=0, max_replicas=10)
    st.requests(*[1.2] * 20)  # 1.2x the target: by latency alone 2 of 1
    # One replica of 2 slots, 7 more waiting: 9 requests need 5 replicas of 2.
    d = st.step(1, in_flight=2, waiting=7, capacity=2, serving=1)
    assert d.replicas == 5


def test_every_target_must_be_met_for_headroom_and_any_missed_scales() -> None:
    spec = _spec(target_p90_queue_wait_s=0.5, upscale_delay_s=0, downscale_delay_s=0)
    clock = FakeClock()
    first, queue = LatencyWindow(20), LatencyWindow(20)
    policy = LatencyPolicy(spec, clock, {"first_token": first, "queue_wait": queue})
    for _ in range(20):
        first.observe(clock.now, clock.now - 0.1, 0.1)
        queue.observe(clock.now, clock.now - 1.0, 1.0)
    d = policy.step(2, StageLoad(**BUSY))
    assert d.direction is Direction.UP and "p90 queue_wait 1.000s over target 0.5s" in d.reason
    with pytest.raises(ValueError, match="no latency window for queue_wait"):
        LatencyPolicy(spec, clock, {"first_token": first})


# -- the recorder feeds the windows --------------------------------------------------


async def test_the_recorder_feeds_queue_wait_and_a_final_stage_first_token() -> None:
    head = Head("echo", {0: 1, 1: 1, 2: 1})
    clock = FakeClock()
    names = {sid: s.name for sid, s in head.orch.graph.stages.items()}
    rec = LatencyRecorder(names, clock=clock)
    head.orch.latency = head.orch.dispatcher.latency = rec
    windows = {
        (f, sid): LatencyWindow(60)
        for f, sid in (("queue_wait", 0), ("first_token", 0), ("first_token", 2))
    }
    for (f, sid), w in windows.items():
        rec.watch(f, sid, w)
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [2]))
    clock.now += 0.2
    head.out(0, 0, 0, "a", finished=True)  # stage 0 is not final: no first token
    clock.now += 0.3
    head.out(1, 0, 0, "b", finished=True)
    clock.now += 0.5
    head.out(2, 0, 0, "c")
    head.out(2, 0, 1, "d", finished=True)
    await collect(stream)
    assert windows["queue_wait", 0].stats(clock.now).samples == 1
    assert windows["first_token", 0].stats(clock.now).samples == 0
    s = windows["first_token", 2].stats(clock.now)
    assert (s.samples, s.p90) == (1, pytest.approx(1.0))


# -- the scaler in latency mode ---------------------------------------------------------


def _config(**scaling: Any) -> Any:
    spec = {"max_replicas": 3, "target_p90_first_token_s": 0.5, **scaling}
    stages = [
        {"stage_id": 0, "name": "a", "engine": "echo", "final_output": True, "autoscaling": spec}
    ]
    return validate_config({"pipeline": "p", "stages": stages})


def test_scaler_scales_on_latency_and_shows_target_p90_and_cause() -> None:
    clock = FakeClock()
    config = _config(upscale_delay_s=0, latency_min_samples=5)
    rec = LatencyRecorder({0: "a"}, clock=clock)
    pool = _pool_with({0: 10})  # full (capacity 10), 15 more waiting: 3 replicas' worth
    pool.waiting = 15
    entries = [_entry(0, ReplicaState.UP)]
    replicas = FakeReplicas({0})
    scaler = Scaler(config, {0}, {0: pool}, lambda: entries, replicas, clock=clock, latency=rec)
    window = rec.windows["first_token"][0]
    assert set(scaler.stages[0].windows) == {"first_token", "queue_wait"}
    assert rec.windows["queue_wait"][0] is scaler.stages[0].windows["queue_wait"]
    for _ in range(6):
        window.observe(clock.now, clock.now - 2.0, 2.0)
    [d] = scaler.tick()
    assert (d.direction, d.cause, d.replicas) == (Direction.UP, Cause.LATENCY, 3)
    view = scaler.status()[0]
    assert view["mode"] == "latency" and view["target_p90_first_token_s"] == 0.5
    assert view["latency"]["first_token"] == {"target_p90_s": 0.5, "p90_s": 2.0, "samples": 6}
    assert view["latency"]["queue_wait"]["target_p90_s"] is None
    assert view["decisions_by_cause"] == {"up": {"latency": 1}, "down": {"headroom": 0, "idle": 0}}
    assert view["last_decision"]["cause"] == "latency"
    assert "p90 first_token 2.000s over target 0.5s" in view["last_decision"]["reason"]
    # Loading: the check says why it holds.
    entries.extend([_entry(1, ReplicaState.STARTING), _entry(2, ReplicaState.STARTING)])
    assert scaler.tick() == []
    assert scaler.status()[0]["check"]["cause"] == "starting"

    stages = [{"stage_id": 0, "autoscaling": scaler.status()[0]}]
    head = SimpleNamespace(
        config=config,
        request_counts=lambda: RequestCounts(0, 0, 0),
        replica_entries=list,
        replica_loads=list,
        stages_status=lambda: {"stages": stages},
        stage_waiting=dict,
        response_counts=lambda mine: mine,
        realtime=lambda mine: mine,
        latency=LatencySnapshot,
    )
    with TestClient(create_app(head)) as client:
        text = client.get("/metrics").text
    labels = 'stage_id="0",stage="a"'
    assert (
        f'omnistage_autoscale_decisions_total{{{labels},direction="up",cause="latency"}} 1' in text
    )
    assert (
        f'omnistage_autoscale_decisions_total{{{labels},direction="down",cause="idle"}} 0' in text
    )
    ft = f'{labels},family="first_token"'
    assert f"omnistage_autoscale_latency_target_seconds{{{ft}}} 0.5" in text
    assert f"omnistage_autoscale_latency_samples{{{ft}}} 0" in text  # since the upscale
    assert f'omnistage_autoscale_latency_samples{{{labels},family="queue_wait"}} 0' in text


def test_scaler_logs_a_missed_target_it_will_not_act_on_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    config = _config(upscale_delay_s=0, latency_min_samples=5)
    rec = LatencyRecorder({0: "a"}, clock=clock)
    entries = [_entry(0, ReplicaState.UP)]
    scaler = Scaler(
        config, {0}, {0: _pool_with({0: 1})}, lambda: entries, FakeReplicas({0}), clock=clock,
        latency=rec,
    )  # fmt: skip
    for _ in range(6):
        rec.windows["first_token"][0].observe(clock.now, clock.now - 2.0, 2.0)
    with caplog.at_level("INFO", logger="omnistage.head.scaler"):
        for _ in range(5):
            assert scaler.tick() == []
            clock.now += 0.25
    holds = [r.getMessage() for r in caplog.records if "holding" in r.getMessage()]
    assert len(holds) == 1 and "load is not the cause" in holds[0]


def test_in_flight_mode_shows_its_windows_without_targets() -> None:
    clock = FakeClock()
    config = validate_config(
        {
            "pipeline": "p",
            "stages": [
                {
                    "stage_id": 0,
                    "name": "a",
                    "engine": "echo",
                    "final_output": True,
                    "output_modality": "audio",
                    "autoscaling": {"max_replicas": 2},
                }
            ],
        }
    )
    rec = LatencyRecorder({0: "a"}, clock=clock)
    entries = [_entry(0, ReplicaState.UP)]
    scaler = Scaler(
        config, {0}, {0: _pool_with({0: 0})}, lambda: entries, FakeReplicas({0}), clock=clock,
        latency=rec,
    )  # fmt: skip
    rec.windows["first_audio"][0].observe(clock.now, clock.now - 0.4, 0.4)
    scaler.tick()
    view = scaler.status()[0]
    assert view["mode"] == "inflight"
    assert view["latency"] == {
        "first_audio": {"target_p90_s": None, "p90_s": 0.4, "samples": 1},
        "queue_wait": {"target_p90_s": None, "p90_s": None, "samples": 0},
    }
    assert view["decisions_by_cause"] == {"up": {"inflight": 0}, "down": {"inflight": 0}}


# -- config ------------------------------------------------------------------------------

STAGE: dict[str, Any] = {"stage_id": 0, "name": "a", "engine": "echo", "final_output": True}


def _load(scaling: dict[str, Any], **stage: Any) -> Any:
    raw = {"pipeline": "p", "stages": [{**copy.deepcopy(STAGE), **stage}]}
    raw["stages"][0]["autoscaling"] = {"max_replicas": 3, **scaling}
    if not raw["stages"][0]["final_output"]:
        raw["stages"].append({**STAGE, "stage_id": 1, "name": "b", "inputs": [0]})
    return validate_config(raw, "x.yaml").stages[0]


def test_config_latency_targets_per_stage_kind() -> None:
    spec = _load({"target_p90_first_token_s": 0.8}).autoscaling
    assert spec.latency_targets == {"first_token": 0.8}
    audio = _load({"target_p90_first_audio_s": 0.5}, output_modality="audio").autoscaling
    assert audio.latency_targets == {"first_audio": 0.5}
    # Queue wait suits any stage, a non-final one too.
    inner = _load({"target_p90_queue_wait_s": 0.1}, final_output=False).autoscaling
    assert inner.latency_targets == {"queue_wait": 0.1}
    assert _load({}).autoscaling.latency_targets == {}


@pytest.mark.parametrize(
    ("scaling", "stage", "where", "says"),
    [
        ({"target_p90_first_token_s": 0}, {}, "target_p90_first_token_s", "greater than 0"),
        ({"target_p90_queue_wait_s": -1}, {}, "target_p90_queue_wait_s", "greater than 0"),
        ({"latency_window_s": 0}, {}, "latency_window_s", "greater than 0"),
        ({"latency_min_samples": 0}, {}, "latency_min_samples", "greater than or equal to 1"),
        ({"busy_fraction": 1.5}, {}, "busy_fraction", "less than or equal to 1"),
        (
            {"target_p90_first_token_s": 1},
            {"output_modality": "audio"},
            "target_p90_first_token_s",
            "final_output: true and output_modality: text",
        ),
        (
            {"target_p90_first_token_s": 1},
            {"final_output": False},
            "target_p90_first_token_s",
            "stage 'a' has final_output: false",
        ),
        (
            {"target_p90_first_audio_s": 1},
            {},
            "target_p90_first_audio_s",
            "output_modality: audio",
        ),
        (
            {"target_p90_first_token_s": 1, "target_inflight_per_replica": 2},
            {},
            "target_inflight_per_replica",
            "either on in-flight requests or on latency targets",
        ),
    ],
)
def test_config_latency_errors_name_the_key(
    scaling: dict[str, Any], stage: dict[str, Any], where: str, says: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _load(scaling, **stage)
    assert f"x.yaml: stages[0].autoscaling.{where}" in str(err.value)
    assert says in str(err.value)


def test_serving_replicas_the_pool_has_not_sized_yet_still_scale_by_one() -> None:
    st = Stage(upscale_delay_s=0)
    st.requests(*[1.5] * 20)
    d = st.step(2, waiting=3, serving=2)  # UP in the table, not in the pool yet
    assert (d.direction, d.replicas) == (Direction.UP, 3)

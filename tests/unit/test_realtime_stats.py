"""Live voice session counters: the pure state, their sum over API server processes, and
how /metrics, the dashboard feed, GET /v1/omni/stages and `omnistage status` show them."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from omnistage.api.app import create_app
from omnistage.api.remote import RemoteService
from omnistage.api.routes.dashboard import latency_body
from omnistage.cli.status import render
from omnistage.config.load import load_config
from omnistage.dataplane.latency import LatencySnapshot
from omnistage.protocol import codec
from omnistage.protocol.front import FrontQuery, FrontSnapshot, RealtimeSnapshot
from omnistage.realtime.stats import (
    FIRST_AUDIO_BUCKETS_S,
    RealtimeStats,
    as_json,
    combine,
    quantile,
)
from tests.unit.fakes import FakeService


def _stats(first_audio: tuple[float, ...] = (0.7, 0.9, 1.2)) -> RealtimeStats:
    stats = RealtimeStats()
    for _ in range(3):
        stats.session_opened()
    stats.session_closed()
    for s in first_audio:
        stats.turn()
        stats.first_audio(s)
    stats.turn()  # a turn with no answer (say, barged in before any audio)
    stats.barge_in()
    return stats


# -- the state -------------------------------------------------------------------------


def test_sessions_turns_barge_ins_and_first_audio_are_counted() -> None:
    snap = _stats().snapshot()
    assert (snap.live_sessions, snap.sessions_total) == (2, 3)
    assert (snap.turns_total, snap.barge_ins_total) == (4, 1)
    assert snap.bounds == FIRST_AUDIO_BUCKETS_S
    assert sum(snap.first_audio_counts) == 3
    assert snap.first_audio_sum == pytest.approx(2.8)
    # 0.7 and 0.9 fall on bounds: counted there, as Prometheus's le.
    at = dict(zip((*snap.bounds, float("inf")), snap.first_audio_counts, strict=True))
    assert (at[0.7], at[0.9], at[1.25]) == (1, 1, 1)


def test_a_close_without_an_open_never_makes_the_gauge_negative() -> None:
    stats = RealtimeStats()
    stats.session_closed()
    assert stats.snapshot().live_sessions == 0


def test_a_snapshot_is_a_copy() -> None:
    stats = RealtimeStats()
    snap = stats.snapshot()
    stats.first_audio(0.5)
    assert sum(snap.first_audio_counts) == 0


def test_quantiles_interpolate_within_a_bucket_like_histogram_quantile() -> None:
    bounds = (1.0, 2.0)
    assert quantile(bounds, [0, 0, 0], 0.5) is None
    assert quantile(bounds, [2, 2, 0], 0.5) == pytest.approx(1.0)
    assert quantile(bounds, [0, 4, 0], 0.5) == pytest.approx(1.5)
    assert quantile(bounds, [0, 0, 3], 0.9) == 2.0  # above every bound: the last bound


def test_combine_adds_counters_and_histograms_and_keeps_live_sessions_a_sum() -> None:
    a, b = _stats().snapshot(), _stats((0.3,)).snapshot()
    total = combine([a, b, RealtimeSnapshot()])
    assert (total.live_sessions, total.sessions_total) == (4, 6)
    assert (total.turns_total, total.barge_ins_total) == (6, 2)
    assert total.first_audio_counts == [
        x + y for x, y in zip(a.first_audio_counts, b.first_audio_counts, strict=True)
    ]
    assert total.first_audio_sum == pytest.approx(3.1)
    assert combine([]) == RealtimeSnapshot()


def test_combine_keeps_counters_of_a_snapshot_with_other_bounds() -> None:
    other = RealtimeStats((1.0,))
    other.session_opened()
    other.first_audio(0.5)
    total = combine([_stats().snapshot(), other.snapshot()])
    assert total.sessions_total == 4
    assert sum(total.first_audio_counts) == 3


# -- across processes ------------------------------------------------------------------


def test_the_snapshot_travels_in_front_query_and_front_snapshot() -> None:
    snap = _stats().snapshot()
    query = FrontQuery(1, {200: 3}, snap)
    assert codec.decode(*codec.encode(query)) == query
    # An API server of before carries none.
    assert codec.decode(*codec.encode(FrontQuery(2, {}))).realtime is None
    front = FrontSnapshot([], b"{}", [0] * 5, b"[]", [], {}, {}, b"", {1: snap})
    assert codec.decode(*codec.encode(front)).realtime == {1: snap}


def test_an_api_server_adds_the_other_servers_sessions_to_its_own() -> None:
    svc = RemoteService(load_config("echo"), "ipc:///nonexistent/front", 1, 0)
    theirs, stale_mine = _stats().snapshot(), _stats((5.0,)).snapshot()
    svc._snapshot = FrontSnapshot([], b"{}", [0] * 5, b"[]", [], {}, {}, b"", {})
    mine = _stats((0.4,)).snapshot()
    assert svc.realtime(mine) == combine([mine])
    # Its own entry in the head's snapshot is older than what it has now: left out.
    svc._snapshot.realtime = {0: theirs, 1: stale_mine}
    total = svc.realtime(mine)
    assert total.live_sessions == 4
    assert total.first_audio_sum == pytest.approx(2.8 + 0.4)


# -- rendering -------------------------------------------------------------------------


def _client(stats: RealtimeStats) -> TestClient:
    app = create_app(FakeService(stages=((0, "listener"),)))
    app.state.realtime_stats = stats  # what the session route counts into
    return TestClient(app)


def test_create_app_gives_each_app_its_own_stats() -> None:
    a, b = create_app(FakeService()), create_app(FakeService())
    assert isinstance(a.state.realtime_stats, RealtimeStats)
    assert a.state.realtime_stats is not b.state.realtime_stats


def test_metrics_show_the_live_voice_families_and_parse_with_the_official_client() -> None:
    with _client(_stats()) as client:
        text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # The parser drops a counter's _total.
    value = {
        name: families[name].samples[0].value
        for name in (
            "omnistage_realtime_live_sessions",
            "omnistage_realtime_sessions",
            "omnistage_realtime_turns",
            "omnistage_realtime_barge_ins",
        )
    }
    assert value == {
        "omnistage_realtime_live_sessions": 2,
        "omnistage_realtime_sessions": 3,
        "omnistage_realtime_turns": 4,
        "omnistage_realtime_barge_ins": 1,
    }
    assert families["omnistage_realtime_live_sessions"].type == "gauge"
    assert families["omnistage_realtime_sessions"].type == "counter"
    assert "omnistage_realtime_sessions_total 3\n" in text
    hist = families["omnistage_realtime_first_audio_seconds"]
    assert hist.type == "histogram"
    samples = {(s.name, s.labels.get("le")): s.value for s in hist.samples}
    assert samples[("omnistage_realtime_first_audio_seconds_bucket", "0.6")] == 0
    assert samples[("omnistage_realtime_first_audio_seconds_bucket", "0.9")] == 2
    assert samples[("omnistage_realtime_first_audio_seconds_bucket", "+Inf")] == 3
    assert samples[("omnistage_realtime_first_audio_seconds_count", None)] == 3
    assert samples[("omnistage_realtime_first_audio_seconds_sum", None)] == pytest.approx(2.8)


def test_metrics_of_a_server_without_sessions_show_zeros() -> None:
    with _client(RealtimeStats()) as client:
        text = client.get("/metrics").text
    assert "omnistage_realtime_live_sessions 0\n" in text
    assert "omnistage_realtime_first_audio_seconds_count 0\n" in text


def test_the_dashboard_feed_and_the_stages_body_carry_the_sessions() -> None:
    snap = _stats().snapshot()
    body = msgspec.json.decode(latency_body(LatencySnapshot(), {}, snap))
    assert body["realtime"] == as_json(snap)
    assert body["realtime"]["first_audio_seconds"]["count"] == 3
    assert (
        msgspec.json.decode(latency_body(LatencySnapshot(), {}))["realtime"]["live_sessions"] == 0
    )
    with _client(_stats()) as client:
        stages = client.get("/v1/omni/stages").json()
    assert stages["realtime"]["sessions_total"] == 3
    assert stages["stages"] == []


def test_status_shows_a_live_voice_line_once_there_was_a_session() -> None:
    data = {"pipeline": "voice", "stages": [], "realtime": as_json(_stats().snapshot())}
    frame = render(data, None, 0.0, False)
    line = next(ln for ln in frame.splitlines() if ln.startswith("live voice"))
    assert "sessions 2 open, 3 total; turns 4; barge-ins 1" in line
    assert "first audio p50 0.85s p90 1.18s (3 answers)" in line
    quiet = {"pipeline": "voice", "stages": [], "realtime": as_json(RealtimeSnapshot())}
    assert "live voice" not in render(quiet, None, 0.0, False)
    assert "live voice" not in render({"pipeline": "echo", "stages": []}, None, 0.0, False)

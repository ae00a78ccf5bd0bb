"""Latency histograms: bucket placement, the recorder driven through a real Orchestrator
with a fake clock (open, dispatch, first chunk, finish, retry), and their exposition."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from omnistage.api.app import create_app
from omnistage.api.prometheus import Exposition
from omnistage.api.remote import RemoteService
from omnistage.config.load import load_config
from omnistage.dataplane.latency import BUCKETS_S, Histogram, LatencyRecorder, LatencySnapshot
from omnistage.protocol.chunk_meta import AudioMeta
from omnistage.protocol.front import FrontSnapshot, PipelineRequest
from omnistage.protocol.messages import OutputChunk, Usage
from omnistage.service import RequestCounts
from tests.unit.fakes import FakeClock, FakeService
from tests.unit.test_orchestrator_retry import PROMPT, Head, collect


def observed(h: Histogram) -> list[float]:
    """The upper bound of the bucket of every observation, in order of bucket."""
    bounds = (*h.bounds, float("inf"))
    return [bounds[i] for i, n in enumerate(h.counts) for _ in range(n)]


# -- Histogram ---------------------------------------------------------------------------


def test_a_value_on_a_bucket_edge_counts_in_that_bucket_like_le() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.0, 0.1, 0.1000001, 1.0, 1.5):
        h.observe(v)
    assert h.counts == [2, 2, 1]
    assert h.cumulative() == [(0.1, 2), (1.0, 4), (float("inf"), 5)]
    assert h.count == 5
    assert h.sum == pytest.approx(2.7000001)


def test_default_buckets_rise_from_5ms_to_a_minute() -> None:
    assert BUCKETS_S[0] == 0.005 and BUCKETS_S[-1] == 60.0
    assert list(BUCKETS_S) == sorted(set(BUCKETS_S))
    h = Histogram()
    h.observe(120.0)
    assert h.cumulative()[-2] == (60.0, 0)
    assert h.cumulative()[-1] == (float("inf"), 1)


# -- the recorder, through the orchestrator -------------------------------------------


def _head(pipeline: str, replicas: dict[int, int]) -> tuple[Head, FakeClock, LatencyRecorder]:
    head = Head(pipeline, replicas)
    clock = FakeClock()
    names = {sid: s.name for sid, s in head.orch.graph.stages.items()}
    recorder = LatencyRecorder(names, clock=clock)
    head.orch.latency = head.orch.dispatcher.latency = recorder
    return head, clock, recorder


async def test_open_dispatch_first_chunk_and_finish_are_timed() -> None:
    head, clock, rec = _head("echo", {0: 1, 1: 1, 2: 1})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [2]))
    # Replicas were free: every stage dispatched at its open.
    for sid in (0, 1, 2):
        assert rec.stages["queue_wait"][sid].count == 1
        assert rec.stages["queue_wait"][sid].sum == 0.0
    clock.now += 0.2
    head.out(0, 0, 0, "a")
    clock.now += 0.3
    head.out(0, 0, 1, "b", finished=True, usage=Usage(completion_tokens=4))
    clock.now += 1.0
    head.out(1, 0, 0, "A", finished=True)
    clock.now += 0.5
    head.out(2, 0, 0, "x")  # a final text stage's first chunk: the first token
    clock.now += 2.0
    head.out(2, 0, 1, "y", finished=True, usage=Usage(completion_tokens=7))
    await collect(stream)

    assert observed(rec.stages["first_output"][0]) == [0.25]
    assert rec.stages["first_output"][0].sum == pytest.approx(0.2)
    assert rec.stages["duration"][0].sum == pytest.approx(0.5)
    # Stage 1's only chunk is both its first output and its end.
    assert rec.stages["first_output"][1].sum == pytest.approx(1.5)
    assert rec.stages["duration"][1].sum == pytest.approx(1.5)
    assert rec.stages["duration"][2].sum == pytest.approx(4.0)
    assert rec.requests["first_token"]["vocoder"].sum == pytest.approx(2.0)
    assert rec.requests["e2e"]["vocoder"].sum == pytest.approx(4.0)
    assert rec.requests["first_audio"] == {}
    # Only final stages' tokens count.
    assert rec.completion_tokens == {0: 0, 1: 0, 2: 7}


async def test_a_retried_stage_is_timed_again_from_its_redispatch() -> None:
    head, clock, rec = _head("echo-1stage", {0: 2})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    failing = head.replica_of(0)
    clock.now += 1.0
    head.out(0, failing, 0, "ab")
    clock.now += 1.0
    head.fail(0, failing)  # the other replica is free: dispatched again at once
    waits = rec.stages["queue_wait"][0]
    assert (waits.count, waits.sum) == (2, 0.0)  # the retry waited from the loss
    clock.now += 0.5
    head.out(0, 1 - failing, 1, "cd", finished=True, attempt=1)
    await collect(stream)

    # The first output of each dispatch: 1.0 s after the first, 0.5 s after the retry.
    assert rec.stages["first_output"][0].count == 2
    assert rec.stages["first_output"][0].sum == pytest.approx(1.5)
    assert rec.stages["duration"][0].count == 1  # the failed dispatch never finished
    assert rec.stages["duration"][0].sum == pytest.approx(0.5)
    assert rec.requests["e2e"]["echo"].sum == pytest.approx(2.5)
    assert rec.requests["first_token"]["echo"].sum == pytest.approx(1.0)


async def test_audio_chunks_count_seconds_and_the_first_one_with_data() -> None:
    head, clock, rec = _head("echo-1stage", {0: 1})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    rid = head.replica_of(0)
    meta = AudioMeta(sample_rate=24000, format="pcm16")

    def audio(seq: int, data: bytes, **kw: object) -> None:
        chunk = OutputChunk("r1", 0, rid, 1, seq, "audio", data=data, meta=meta, **kw)  # type: ignore[arg-type]
        head.orch.on_outputs([chunk])

    clock.now += 0.1
    audio(0, b"")  # an empty chunk (an ack) is no output yet
    clock.now += 0.2
    audio(1, b"\0" * 48000)  # half a second
    clock.now += 0.3
    audio(2, b"\0" * 24000, finished=True)
    await collect(stream)

    assert rec.stages["first_output"][0].sum == pytest.approx(0.3)
    assert rec.requests["first_audio"]["echo"].sum == pytest.approx(0.3)
    assert rec.requests["first_token"] == {}
    assert rec.audio_seconds[0] == pytest.approx(1.5)


async def test_a_request_that_fails_has_no_end_to_end_time() -> None:
    head, _, rec = _head("echo-1stage", {0: 1})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    head.out(0, head.replica_of(0), 0, "", error="boom", finished=True)
    with pytest.raises(Exception, match="boom"):
        await collect(stream)
    assert rec.requests["e2e"] == {}
    assert rec.stages["duration"][0].count == 0


# -- exposition --------------------------------------------------------------------------


def test_the_histogram_text_is_prometheus_format() -> None:
    h = Histogram((0.5, 1.0))
    h.observe(0.5)
    h.observe(2.0)
    out = Exposition()
    out.histogram("x_seconds", "Help.", [({"stage": "a"}, h)])
    assert out.text() == (
        "# HELP x_seconds Help.\n"
        "# TYPE x_seconds histogram\n"
        'x_seconds_bucket{stage="a",le="0.5"} 1\n'
        'x_seconds_bucket{stage="a",le="1.0"} 1\n'
        'x_seconds_bucket{stage="a",le="+Inf"} 2\n'
        'x_seconds_sum{stage="a"} 2.5\n'
        'x_seconds_count{stage="a"} 2\n'
    )


def _metrics_text() -> str:
    """/metrics of a two-stage head with a few observations."""
    rec = LatencyRecorder({0: "thinker", 1: "talker"})
    rec.stages["duration"][1].observe(0.3)
    rec.requests["e2e"]["talker"] = Histogram()
    rec.requests["e2e"]["talker"].observe(0.7)
    rec.audio_seconds[1] = 2.5
    head = FakeService(
        stages=((0, "thinker"), (1, "talker")),
        counts=RequestCounts(1, 0, 0),
        latency=rec.snapshot,
    )
    with TestClient(create_app(head)) as client:
        return client.get("/metrics").text


def test_metrics_with_latency_parse_with_the_official_client() -> None:
    text = _metrics_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    duration = families["omnistage_stage_duration_seconds"]
    assert duration.type == "histogram"
    samples = {
        (s.name, s.labels.get("stage"), s.labels.get("le")): s.value for s in duration.samples
    }
    assert samples[("omnistage_stage_duration_seconds_bucket", "talker", "0.25")] == 0
    assert samples[("omnistage_stage_duration_seconds_bucket", "talker", "0.5")] == 1
    assert samples[("omnistage_stage_duration_seconds_bucket", "talker", "+Inf")] == 1
    assert samples[("omnistage_stage_duration_seconds_count", "talker", None)] == 1
    assert samples[("omnistage_stage_duration_seconds_sum", "talker", None)] == 0.3
    assert samples[("omnistage_stage_duration_seconds_count", "thinker", None)] == 0
    e2e = families["omnistage_request_e2e_seconds"]
    assert {s.labels["kind"] for s in e2e.samples} == {"talker"}
    audio = families["omnistage_audio_seconds"]  # the parser drops a counter's _total
    assert audio.type == "counter"
    assert [s.value for s in audio.samples if s.labels["stage"] == "talker"] == [2.5]


def test_an_api_server_reads_the_heads_histograms_from_its_snapshot() -> None:
    rec = LatencyRecorder({0: "a"})
    rec.stages["queue_wait"][0].observe(0.02)
    rec.requests["first_token"]["a"] = Histogram()
    rec.requests["first_token"]["a"].observe(1.0)
    # The socket only connects lazily: no head is needed to read a snapshot.
    svc = RemoteService(load_config("echo"), "ipc:///nonexistent/front", 1, 0)
    svc._snapshot = FrontSnapshot([], b"{}", [0] * 5, b"[]", b"[]", {}, {})
    assert svc.latency() == LatencySnapshot()  # from a head that sends none
    svc._snapshot.latency_json = msgspec.json.encode(rec.snapshot())
    snap = svc.latency()
    assert snap == rec.snapshot()
    assert snap.histogram(snap.stages["queue_wait"][0]).cumulative()[2] == (0.025, 1)


DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana-omnistage.json"


def test_the_grafana_dashboard_queries_only_families_metrics_renders() -> None:
    text = _metrics_text()
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["__inputs"][0]["name"] == "DS_PROMETHEUS"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    for name in {n for e in exprs for n in re.findall(r"omnistage_\w+", e)}:
        family = name.removesuffix("_bucket")
        assert f"# TYPE {family} " in text, name

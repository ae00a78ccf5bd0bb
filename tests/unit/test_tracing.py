"""Traces of requests (omnistage.tracing): off costs nothing, the traceparent round trip,
and the spans the orchestrator and a replica's runner make, caught in memory."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from omnistage import tracing
from omnistage.engines.echo import EchoEngine
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import AddRequest, OutputChunk, PeerConnector
from omnistage.replica.requests import RequestRunner
from tests.unit.fakes import others_done, until
from tests.unit.test_orchestrator_retry import PROMPT, Head, collect


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.enable(SimpleSpanProcessor(exporter), "test")
    yield exporter
    tracing.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for span in exporter.get_finished_spans():
        out.setdefault(span.name, []).append(span)
    return out


def test_off_by_default_the_orchestrator_gets_the_no_op_hooks() -> None:
    assert not tracing.enabled()
    head = Head("echo-1stage", {0: 1})
    assert head.orch.traces is tracing.NO_TRACES
    assert tracing.start_replica_span("00-" + "1" * 32 + "-" + "2" * 16 + "-01", {}) is None


def test_configure_without_an_endpoint_stays_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert tracing.configure(None, "omnistage-head") is False
    assert not tracing.enabled()


def test_without_the_packages_an_endpoint_warns_once_and_stays_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # None in sys.modules makes the import fail as if the package were not installed.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    assert tracing.configure("http://127.0.0.1:1/v1/traces", "omnistage-head") is False
    assert not tracing.enabled()
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "omnistage[otel]" in caplog.text


def test_traceparent_round_trip() -> None:
    text = tracing.encode_traceparent(0xABC, 0x123, sampled=True)
    assert text == "00-00000000000000000000000000000abc-0000000000000123-01"
    assert tracing.decode_traceparent(text) == (0xABC, 0x123, True)
    assert tracing.decode_traceparent(tracing.encode_traceparent(1, 2, False)) == (1, 2, False)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "garbage",
        "00-" + "0" * 32 + "-" + "1" * 16 + "-01",  # zero trace id
        "00-" + "1" * 32 + "-" + "0" * 16 + "-01",  # zero span id
        "ff-" + "1" * 32 + "-" + "1" * 16 + "-01",  # forbidden version
        "00-" + "1" * 31 + "-" + "1" * 16 + "-01",
        "00-" + "g" * 32 + "-" + "1" * 16 + "-01",
        "00-" + "1" * 32 + "-" + "1" * 16 + "-01-extra",  # version 00 has 4 fields
    ],
)
def test_invalid_traceparents_are_refused(bad: str) -> None:
    assert tracing.decode_traceparent(bad) is None


async def test_a_request_has_a_root_and_a_stage_span_per_stage(
    spans: InMemorySpanExporter,
) -> None:
    head = Head("echo", {0: 1, 1: 1, 2: 1})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [2]))
    adds = [msg for _, msg in head.channels.take() if isinstance(msg, AddRequest)]
    for sid in (0, 1, 2):
        head.out(sid, 0, 0, "x", finished=True)
    await collect(stream)

    found = by_name(spans)
    (root,) = found["omnistage.request"]
    assert root.parent is None
    assert root.attributes["omnistage.request_id"] == "r1"
    assert root.attributes["omnistage.pipeline"] == "echo"
    assert root.attributes["omnistage.outcome"] == "ok"
    stage_spans = [
        s for name, ss in found.items() if name.startswith("omnistage.stage ") for s in ss
    ]
    assert len(stage_spans) == 3
    for span in stage_spans:
        assert span.parent.span_id == root.context.span_id
        assert span.context.trace_id == root.context.trace_id
        assert span.attributes["omnistage.retry"] is False
        assert span.attributes["omnistage.outcome"] == "ok"
    # Each AddRequest carries its own stage span's context.
    carried = {tracing.decode_traceparent(a.trace)[1] for a in adds}  # type: ignore[index]
    assert carried == {s.context.span_id for s in stage_spans}


async def test_a_retried_stage_shows_as_two_spans(spans: InMemorySpanExporter) -> None:
    head = Head("echo-1stage", {0: 2})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    failing = head.replica_of(0)
    head.out(0, failing, 0, "ab")
    head.fail(0, failing)
    head.out(0, 1 - failing, 1, "cd", finished=True, attempt=1)
    await collect(stream)

    found = by_name(spans)
    (root,) = found["omnistage.request"]
    first, second = sorted(found["omnistage.stage echo"], key=lambda s: s.start_time)
    assert (first.attributes["omnistage.replica_id"], first.attributes["omnistage.retry"]) == (
        failing,
        False,
    )
    assert first.attributes["omnistage.outcome"] == "replica lost"
    assert second.attributes["omnistage.replica_id"] == 1 - failing
    assert second.attributes["omnistage.retry"] is True
    assert second.attributes["omnistage.attempt"] == 1
    assert first.parent.span_id == second.parent.span_id == root.context.span_id


async def test_a_request_the_client_leaves_ends_its_spans(spans: InMemorySpanExporter) -> None:
    head = Head("echo-1stage", {0: 1})
    stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    stream.close()
    found = by_name(spans)
    assert found["omnistage.request"][0].attributes["omnistage.outcome"] == "cancelled"
    assert found["omnistage.stage echo"][0].attributes["omnistage.outcome"] == "aborted"


async def test_an_incoming_traceparent_parents_the_root(spans: InMemorySpanExporter) -> None:
    head = Head("echo-1stage", {0: 1})
    token = tracing.incoming_parent.set(tracing.encode_traceparent(0x77, 0x88))
    try:
        stream = await head.orch.open(PipelineRequest("r1", PROMPT, [0]))
    finally:
        tracing.incoming_parent.reset(token)
    stream.close()
    (root,) = by_name(spans)["omnistage.request"]
    assert root.context.trace_id == 0x77
    assert root.parent.span_id == 0x88


class _Outlet:
    def __init__(self) -> None:
        self.head: list[OutputChunk] = []

    def to_head(self, chunks: list[OutputChunk]) -> None:
        self.head.extend(chunks)

    def to_peer(self, address: str, chunks: list[OutputChunk], connector: PeerConnector) -> None:
        pass


async def test_the_replica_span_continues_the_head_stage_span(
    spans: InMemorySpanExporter,
) -> None:
    head = Head("echo-1stage", {0: 1})
    runner = RequestRunner(0, EchoEngine(head.orch.graph.config.stages[0]), lambda _: None)
    outlet = _Outlet()
    runner.bind(3, 1, outlet)
    traceparent = tracing.encode_traceparent(0x55, 0x66)
    runner.add(AddRequest("r1", PROMPT, [], {}, trace=traceparent))
    await until(lambda: outlet.head and outlet.head[-1].finished, what="the last chunk")
    (span,) = by_name(spans)["omnistage.replica.generate"]
    assert span.context.trace_id == 0x55
    assert span.parent.span_id == 0x66
    assert span.attributes["omnistage.replica_id"] == 3
    assert span.attributes["omnistage.engine"] == runner.engine.name
    # Chunks as made, before a tick's chunks are merged for the wire.
    assert span.attributes["omnistage.output_chunks"] == runner.chunks_sent > 1


async def test_a_replica_span_ends_when_its_request_is_aborted_before_it_starts(
    spans: InMemorySpanExporter,
) -> None:
    head = Head("echo-1stage", {0: 1})
    runner = RequestRunner(0, EchoEngine(head.orch.graph.config.stages[0]), lambda _: None)
    runner.bind(0, 1, _Outlet())
    runner.add(AddRequest("r1", PROMPT, [], {}, trace=tracing.encode_traceparent(1, 2)))
    runner.abort("r1")
    await others_done()
    (span,) = by_name(spans)["omnistage.replica.generate"]
    assert span.attributes["omnistage.outcome"] == "aborted"

"""Traces across processes: a real echo head and its replica processes export to an
OTLP HTTP receiver in this test, and one request's spans form one tree."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from omnistage import tracing
from tests.integration.harness import HeadProc, wait_for

STAGES = ("thinker", "talker", "vocoder")  # the echo pipeline


class Receiver:
    """POST /v1/traces: keeps every span with its exporter's service.name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest.FromString(body)
                receiver.add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((service, s) for s in scope_spans.spans)


def _attr(span: Any, key: str) -> Any:
    for a in span.attributes:
        if a.key == key:
            value = a.value
            return getattr(value, value.WhichOneof("value"))
    return None


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    r = Receiver()
    # Export within tens of milliseconds, not the default 5 s.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    yield r
    r.server.shutdown()


def test_one_request_makes_one_trace_across_head_and_replicas(
    tmp_path: Path, receiver: Receiver
) -> None:
    head = HeadProc(tmp_path, "echo", "--otlp-traces-endpoint", receiver.url)
    caller = tracing.encode_traceparent(0xC0FFEE, 0xBEEF)
    try:
        head.wait_healthy()
        reply = head.client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers={"traceparent": caller},
        )
        assert reply.status_code == 200, reply.text
        request_id = reply.json()["id"]

        def complete() -> list[Any] | None:
            spans = [s for _, s in receiver.spans]
            roots = [
                s
                for s in spans
                if _attr(s, "omnistage.request_id") == request_id and s.name == "omnistage.request"
            ]
            if not roots:
                return None
            mine = [s for s in spans if s.trace_id == roots[0].trace_id]
            return mine if len(mine) >= 1 + 2 * len(STAGES) else None

        spans = wait_for(complete, 15, 0.1, "the request's spans at the receiver")
    finally:
        head.stop()

    services = {id(s): svc for svc, s in receiver.spans}
    (root,) = [s for s in spans if s.name == "omnistage.request"]
    # The caller's traceparent is the root's parent: one trace from the client on.
    assert root.trace_id == (0xC0FFEE).to_bytes(16, "big")
    assert root.parent_span_id == (0xBEEF).to_bytes(8, "big")
    assert _attr(root, "omnistage.pipeline") == "echo"
    assert _attr(root, "omnistage.outcome") == "ok"
    assert _attr(root, "omnistage.stream") is False
    assert services[id(root)] == "omnistage-head"

    head_stages = {
        s.name.removeprefix("omnistage.stage "): s
        for s in spans
        if s.name.startswith("omnistage.stage ")
    }
    assert sorted(head_stages) == sorted(STAGES)
    for span in head_stages.values():
        assert span.parent_span_id == root.span_id

    replica_spans = [s for s in spans if s.name == "omnistage.replica.generate"]
    assert len(replica_spans) == len(STAGES)
    by_id = {s.span_id: s for s in head_stages.values()}
    for span in replica_spans:
        parent = by_id[span.parent_span_id]
        stage_id = _attr(span, "omnistage.stage_id")
        assert _attr(parent, "omnistage.stage_id") == stage_id
        assert _attr(parent, "omnistage.replica_id") == _attr(span, "omnistage.replica_id")
        assert _attr(span, "omnistage.output_chunks") >= 1
        assert services[id(span)] == f"omnistage-replica-{stage_id}"

"""OpenTelemetry traces of requests: off, and free, unless an OTLP endpoint is configured.

One trace per request: a root span on the head (``omnistage.request``), a child per stage
dispatch (``omnistage.stage <name>``, ended when the stage finishes or its replica is
lost, so a retried stage shows twice), and on each replica a span per request it runs
(``omnistage.replica.generate``), a child of the head's stage span. The head's span
context crosses to the replica in ``AddRequest.trace`` as a W3C ``traceparent``.

opentelemetry is imported only by ``configure`` when an endpoint is set. Until then the
orchestrator holds ``NO_TRACES``, whose methods do nothing (no span objects, no context
encoding), and ``start_replica_span`` returns None after one test.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Set
from typing import Any, Protocol

from omnistage import envs
from omnistage.protocol.enums import Outcome


class Run(Protocol):
    """What the head's hooks read of a request's run (``dataplane.run.Run``)."""

    request_id: str
    active: Set[int]
    finals: Set[int]
    finished: Set[int]
    failed: bool

    def progress(self, stage_id: int) -> Any: ...


class ReplicaHandle(Protocol):
    """What the hooks read of the replica a stage was sent to."""

    replica_id: int


log = logging.getLogger(__name__)

# A tracer from our own provider (not the global one: omnistage is not the app's owner of
# OpenTelemetry), or None: tracing is off.
_tracer: Any = None
_provider: Any = None

# Set for the duration of an HTTP request that carried a ``traceparent`` (api.fastpath):
# the orchestrator's root span becomes its child. The orchestrator's ``open`` runs in the
# handler's task, so it sees the value.
incoming_parent: contextvars.ContextVar[str] = contextvars.ContextVar(
    "omnistage_traceparent", default=""
)
# Whether the route answers with a stream (``mark_stream``), likewise for the root span.
_stream: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "omnistage_stream", default=None
)


def enabled() -> bool:
    return _tracer is not None


def endpoint_from_env() -> str | None:
    """The OTLP endpoint the standard variables name (traces-specific first), if any."""
    return envs.otlp_traces_endpoint()


def configure(endpoint: str | None, service_name: str) -> bool:
    """Turn tracing on when ``endpoint`` (``--otlp-traces-endpoint``, a full traces URL)
    or the OTEL_EXPORTER_OTLP_* variables name one; export over OTLP HTTP/protobuf in
    batches. Without the packages: one warning, and tracing stays off."""
    if not endpoint and not endpoint_from_env():
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning(
            "an OTLP traces endpoint is set but OpenTelemetry is not installed "
            "(pip install 'omnistage[otel]'): tracing is off"
        )
        return False
    # Without an explicit endpoint the exporter reads the OTEL_* variables itself (and
    # appends /v1/traces to OTEL_EXPORTER_OTLP_ENDPOINT, as the spec says).
    exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    enable(BatchSpanProcessor(exporter), service_name)
    log.info("exporting traces to %s", endpoint or endpoint_from_env())
    return True


def enable(processor: Any, service_name: str) -> None:
    """Tracing on, spans ending in ``processor`` (tests pass a SimpleSpanProcessor over an
    InMemorySpanExporter)."""
    global _tracer, _provider
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    name = envs.otel_service_name() or service_name
    _provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    _provider.add_span_processor(processor)
    _tracer = _provider.get_tracer("omnistage")


def shutdown() -> None:
    """Export what is batched and turn tracing off (at process exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


# -- the W3C traceparent ----------------------------------------------------------------


def encode_traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def decode_traceparent(text: str) -> tuple[int, int, bool] | None:
    """(trace id, span id, sampled), or None for anything not a valid version-00 value."""
    parts = text.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff":
        return None
    version, trace_hex, span_hex, flags = parts[:4]
    if len(trace_hex) != 32 or len(span_hex) != 16 or len(flags) != 2:
        return None
    if version == "00" and len(parts) != 4:
        return None
    try:
        trace_id, span_id, bits = int(trace_hex, 16), int(span_hex, 16), int(flags, 16)
    except ValueError:
        return None
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, bool(bits & 1)


def _context(traceparent: str) -> Any:
    """An OpenTelemetry context whose current span is the remote parent, or None."""
    decoded = decode_traceparent(traceparent) if traceparent else None
    if decoded is None:
        return None
    from opentelemetry import trace

    trace_id, span_id, sampled = decoded
    parent = trace.SpanContext(
        trace_id,
        span_id,
        is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED if sampled else 0),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def _traceparent(span: Any) -> str:
    ctx = span.get_span_context()
    return encode_traceparent(ctx.trace_id, ctx.span_id, ctx.trace_flags.sampled)


def _end(span: Any, outcome: Outcome) -> None:
    span.set_attribute("omnistage.outcome", str(outcome))
    if outcome == Outcome.ERROR:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR))
    span.end()


# -- the head's spans ---------------------------------------------------------------------


class RequestTraces:
    """The orchestrator's hooks; this base does nothing (tracing off).

    The hooks take what the orchestrator has at hand and read the rest themselves, so
    that with tracing off a hook costs the call and nothing else (as the latency
    recorder's)."""

    __slots__ = ()

    def opened(self, run: Run) -> None:
        pass

    def dispatched(self, run: Run, stage_id: int, handle: ReplicaHandle) -> str:
        """A stage's dispatch starts; returns the ``traceparent`` for its AddRequest."""
        return ""

    def stage_ended(self, run: Run, stage_id: int, outcome: Outcome) -> None:
        pass

    def ended(self, run: Run, outcome: Outcome = Outcome.DERIVE) -> None:
        """The request ended; ``outcome`` DERIVE derives it from the run: error (failed), ok
        (every stage finished) or cancelled (the client left)."""


NO_TRACES = RequestTraces()


class _Trace:
    """One request's open spans: the root, and each stage's current dispatch."""

    __slots__ = ("dispatches", "root", "stages")

    def __init__(self, root: Any) -> None:
        self.root = root
        self.stages: dict[int, Any] = {}
        self.dispatches: dict[int, int] = {}  # per stage, to mark the retries


class _SpanTraces(RequestTraces):
    __slots__ = ("_names", "_pipeline", "_traces")

    def __init__(self, pipeline: str, names: dict[int, str]) -> None:
        self._pipeline = pipeline
        self._names = names
        self._traces: dict[str, _Trace] = {}

    def opened(self, run: Run) -> None:
        attributes: dict[str, Any] = {
            "omnistage.request_id": run.request_id,
            "omnistage.pipeline": self._pipeline,
            "omnistage.final_stages": [self._names[sid] for sid in sorted(run.finals)],
        }
        # The route says whether it streams (``mark_stream``) before it opens.
        stream = _stream.get()
        if stream is not None:
            attributes["omnistage.stream"] = stream
        root = _tracer.start_span(
            "omnistage.request", context=_context(incoming_parent.get()), attributes=attributes
        )
        self._traces[run.request_id] = _Trace(root)

    def dispatched(self, run: Run, stage_id: int, handle: ReplicaHandle) -> str:
        t = self._traces.get(run.request_id)
        if t is None:
            return ""
        from opentelemetry import trace

        if (previous := t.stages.pop(stage_id, None)) is not None:
            _end(previous, "replaced")
        count = t.dispatches[stage_id] = t.dispatches.get(stage_id, 0) + 1
        span = t.stages[stage_id] = _tracer.start_span(
            f"omnistage.stage {self._names[stage_id]}",
            context=trace.set_span_in_context(t.root),
            attributes={
                "omnistage.stage_id": stage_id,
                "omnistage.replica_id": handle.replica_id,
                "omnistage.attempt": run.progress(stage_id).attempt,
                "omnistage.retry": count > 1,
            },
        )
        return _traceparent(span)

    def stage_ended(self, run: Run, stage_id: int, outcome: Outcome) -> None:
        t = self._traces.get(run.request_id)
        span = t.stages.pop(stage_id, None) if t is not None else None
        if span is not None:
            _end(span, outcome)

    def ended(self, run: Run, outcome: Outcome = Outcome.DERIVE) -> None:
        t = self._traces.pop(run.request_id, None)
        if t is None:
            return
        if outcome == Outcome.DERIVE:
            done = run.active <= run.finished
            outcome = Outcome.ERROR if run.failed else Outcome.OK if done else Outcome.CANCELLED
        for span in t.stages.values():
            _end(span, Outcome.ERROR if outcome == Outcome.ERROR else Outcome.ABORTED)
        _end(t.root, outcome)


def request_traces(pipeline: str, names: dict[int, str]) -> RequestTraces:
    """The orchestrator's hooks (``names``: stage names by id): real spans when tracing
    is on, else ``NO_TRACES``."""
    return _SpanTraces(pipeline, names) if _tracer is not None else NO_TRACES


def mark_stream(body: object) -> None:
    """A generation route parsed its ``body``: whether the answer streams goes on the
    request's root span (the route opens the request in this same task, after this)."""
    if _tracer is not None:
        _stream.set(bool(getattr(body, "stream", False)))


# -- the replica's span -------------------------------------------------------------------


def start_replica_span(traceparent: str, attributes: dict[str, Any]) -> Any:
    """``omnistage.replica.generate`` under the head's stage span, or None (tracing off
    here, or the head sent no context)."""
    if _tracer is None or not traceparent:
        return None
    return _tracer.start_span(
        "omnistage.replica.generate", context=_context(traceparent), attributes=attributes
    )


def end_replica_span(span: Any, chunks: int, outcome: Outcome) -> None:
    span.set_attribute("omnistage.output_chunks", chunks)
    _end(span, outcome)

"""Every message that crosses a process boundary, as typed msgspec Structs.

Two families:
- Registration (replica DEALER -> master ROUTER, ``protocol.registration``) is one
  msgpack *map* each way with the seed's keys.
- Everything else travels as two frames ``[tag, body]``: a one-byte type tag and the
  msgpack body of the Struct bound to that tag (see ``codec``). Bodies are array-like
  structs: compact, and fast to encode on the hot path.
"""

from __future__ import annotations

from typing import Any

import msgspec

from omnistage.protocol.enums import (
    ErrorKind,
    FinishReason,
    Modality,
    Reason,
    ReplicaState,
)
from omnistage.protocol.params import StageParams

__all__ = ["Reason", "ReplicaState"]  # re-exported: they were declared here first

PROTOCOL_VERSION = 1


def routing_id(stage_id: int, replica_id: int, epoch: int) -> bytes:
    """A replica incarnation's routing id on the head's input socket."""
    return f"{stage_id}.{replica_id}.{epoch}".encode()


# --------------------------------------------------------------------------------------
# Tagged messages (two frames: tag, body)
# --------------------------------------------------------------------------------------


class _Tagged(msgspec.Struct, array_like=True, omit_defaults=False):
    pass


class Hello(_Tagged):
    """Replica -> head handshake socket: 'I registered as (stage, replica, epoch)'."""

    stage_id: int
    replica_id: int
    epoch: int
    pid: int
    host: str
    protocol_version: int = PROTOCOL_VERSION


class HandshakeInit(_Tagged):
    """Head -> replica: everything the replica needs to load its engine and serve."""

    stage_config: dict[str, Any]
    input_address: str
    output_address: str
    coordinator_address: str
    heartbeat_interval_s: float
    stage_init_timeout_s: float
    error: str | None = None
    # The head's --omni-heartbeat-timeout: how long the replica may go without a
    # HeartbeatAck before it decides the head is gone and registers again.
    heartbeat_timeout_s: float = 5.0


class Ready(_Tagged):
    """Replica -> head, sent on the *input* channel once the engine is loaded.

    Travelling on the data socket (not the handshake socket) proves the request path
    is connected before the head routes any traffic to the replica.
    """

    stage_id: int
    replica_id: int
    epoch: int
    capacity: int
    engine: str
    pid: int
    address: str
    # Where other replicas push this one's inputs straight to it (a PULL socket it
    # binds); empty when it takes inputs only through the head.
    peer_address: str = ""


class ToolCall(msgspec.Struct, array_like=True):
    """A function call the model made (OpenAI's ``tool_calls`` entry)."""

    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class ChatMessage(msgspec.Struct, array_like=True):
    role: str
    content: str
    # An assistant turn's calls, and a tool turn's answer to one (chat history).
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class TopLogprob(msgspec.Struct, array_like=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct, array_like=True):
    """One sampled token with its log probability and the most likely alternatives
    (OpenAI's ``logprobs.content`` entry)."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class Prompt(_Tagged):
    """Client input: chat messages or plain text, and audio to listen to (the bytes of
    an uploaded file, e.g. WAV or MP3, decoded by the stage that reads it)."""

    text: str | None = None
    messages: list[ChatMessage] | None = None
    audio: bytes | None = None
    audio_format: str | None = None  # the client's hint ("wav", "mp3", ...), if any
    # The rate of raw ``audio_format="pcm16"`` audio (little-endian int16 mono), which
    # carries no header to say it.
    sample_rate: int | None = None

    def modalities(self) -> frozenset[str]:
        has_text = self.text is not None or self.messages is not None
        if self.audio is None:
            return _TEXT if has_text else frozenset()
        return _TEXT_AUDIO if has_text else _AUDIO


_TEXT, _AUDIO = frozenset({Modality.TEXT}), frozenset({Modality.AUDIO})
_TEXT_AUDIO = _TEXT | _AUDIO


class Resume(_Tagged):
    """What a stage already delivered for a request, sent with a retry on another
    replica after the first one failed.

    ``text`` is all text output so far, ``data_chunks`` the count of chunks that
    carried data (audio, images), ``seq`` the next output sequence number. An engine
    that can continue (an LLM: prompt plus the text so far) generates only what is
    new; any other engine runs again and the replica drops the first ``len(text)``
    characters and ``data_chunks`` data chunks, so the client never sees a piece twice.
    """

    text: str
    data_chunks: int
    seq: int
    # Completion tokens behind ``text`` as the failed replica counted them (from the
    # usage its chunks carried); 0 when unknown. Re-encoding the text may give fewer.
    tokens: int = 0


class AddRequest(_Tagged):
    """Head -> replica: start a request.

    ``upstream`` lists the stages whose outputs will arrive as this request's input
    (OutputChunk messages of those stages, from the head or pushed by their replicas);
    empty for source stages, which read ``prompt`` instead. ``resume`` is set on a
    retry after a replica failure.

    ``peers`` are the peer addresses of the replicas of downstream stages that take this
    stage's outputs straight from this replica (the connector seam). The head then gets
    only the last chunk (or an error) unless ``head_all`` says it needs every chunk (the
    stage is a final one, or some downstream stage takes its input through the head).
    ``attempt`` numbers the runs of one request: chunks of an earlier attempt are
    dropped by whoever receives them.
    """

    request_id: str
    prompt: Prompt | None
    upstream: list[int]
    params: StageParams
    resume: Resume | None = None
    attempt: int = 0
    peers: list[str] = []
    head_all: bool = True
    # Check the params first and answer at once: an error, or an empty chunk that says
    # they are fine (the API holds a stream's status line until every final stage has).
    ack: bool = False
    # The head's stage span as a W3C traceparent ("" when tracing is off): the replica's
    # span continues it. Last, so a replica that predates it ignores it.
    trace: str = ""
    # The prompt is the first piece of a streamed input: more follows as InputChunks.
    input_streaming: bool = False


class InputChunk(_Tagged):
    """Head -> replica: the next piece of a request's streamed input
    (``PipelineRequest.input_streaming``), for a stage that reads the prompt.

    ``seq`` numbers the pieces from 0 (the prompt itself is not counted); a retry on
    another replica gets every piece again from 0, so a receiver takes exactly the
    next one and drops repeats. ``last`` ends the input (``data`` may be empty).
    """

    request_id: str
    attempt: int
    seq: int
    data: bytes
    last: bool = False


class Abort(_Tagged):
    request_id: str


class Shutdown(_Tagged):
    reason: str


class Ping(_Tagged):
    """Head -> replica, ignored by the replica: a send that fails (ROUTER_MANDATORY)
    proves the replica's connection is gone."""


class Segment(msgspec.Struct, frozen=True):
    """One segment of a transcript, as OpenAI's verbose_json has it (times in seconds)."""

    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class ChunkMeta(msgspec.Struct, omit_defaults=True, frozen=True):
    """What a chunk's bytes or text are, by modality; unset fields are left out.

    - audio: ``sample_rate``, ``format`` ("pcm16"), ``voice``;
    - tool_call: ``index`` and ``name`` of the call the arguments belong to;
    - image: ``index`` of the image in the request, then either ``step`` of ``steps``
      (progress, no data) or ``format``, ``width``, ``height`` and ``seed`` (the file);
    - text of a transcription: ``segment`` (one per chunk), and on the last chunk the
      detected ``language`` and the audio's ``duration``.
    """

    sample_rate: int | None = None
    format: str | None = None
    voice: str | None = None
    index: int | None = None
    name: str | None = None
    step: int | None = None
    steps: int | None = None
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    segment: Segment | None = None
    language: str | None = None
    duration: float | None = None


class OutputChunk(_Tagged):
    """One piece of a stage's output for a request: the one chunk type end to end.

    A replica makes it once from what its engine yields; the same message then goes to
    the head (which hands it to the API as is), and to the replicas of downstream
    stages, straight or through the head, whose engines read it as their input.

    ``modality`` TOOL_CALL: ``text`` is the next piece of a function call's JSON
    arguments and ``meta`` says which call (``index``, ``name``).
    """

    request_id: str
    stage_id: int
    replica_id: int
    epoch: int
    seq: int
    modality: Modality
    text: str = ""
    data: bytes = b""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    usage: dict[str, int] | None = None
    meta: ChunkMeta | None = None
    # With ``error``: BAD_REQUEST when the input cannot be served (a 4xx for the
    # client, e.g. a prompt longer than the context window), else a server fault.
    error_kind: ErrorKind | None = None
    error_param: str | None = None
    attempt: int = 0
    error_code: str | None = None  # with BAD_REQUEST: OpenAI's error code
    # The tokens behind ``text``, when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None


class Heartbeat(_Tagged):
    """Replica -> coordinator, every heartbeat interval and once with status DOWN at exit."""

    stage_id: int
    replica_id: int
    epoch: int
    status: ReplicaState  # UP | DRAINING | DOWN
    queue_length: int
    in_flight: int
    progress: int
    seq: int
    # While STARTING (the engine loading): what it is doing, e.g. "converting the GGUF".
    detail: str = ""


class HeartbeatAck(_Tagged):
    """Coordinator -> replica, for each heartbeat: what the head thinks of the sender.

    ``state`` is the replica's state in the head's table, or UNKNOWN when the head
    has no such incarnation (it restarted, or a newer registration replaced this one).
    A replica told UNKNOWN or ERROR, or told nothing for long enough, registers again
    (keeping its loaded engine): the head restarted, or it will not route to us.
    """

    state: ReplicaState
    head_instance: str


# --------------------------------------------------------------------------------------
# API servers <-> head (--api-server-count > 1; a private ipc socket on the head's host)
# --------------------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct, array_like=True):
    """An error as the HTTP API answers it (status and OpenAI's error body)."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class PipelineRequest(_Tagged):
    """One request through the pipeline, as the API asks the head to start it
    (``PipelineService.open``; the same message from an API server process).

    ``finals`` are the stages whose outputs answer the client. ``params`` go to every
    stage the request runs, ``stage_params`` to one stage each, over the stage's own
    defaults. ``only``: run just the ``finals`` stages, each fed the prompt directly (e.g.
    the speech endpoint driving a TTS stage that normally listens to an LLM). ``ack``:
    each final stage first checks its params and answers at once (an error, or an empty
    chunk), so a caller can wait for every final's first chunk.
    """

    request_id: str
    prompt: Prompt
    finals: list[int]
    params: StageParams = StageParams()
    stage_params: dict[int, StageParams] = {}
    only: bool = False
    ack: bool = False
    # Requests with the same key go to the replica that took the key last while it is
    # up and has room (a Realtime session's turns: its thinker's prefix cache).
    affinity: str = ""
    # ``prompt`` is only the first piece of the input; the rest arrives through the
    # stream's ``feed`` (appended to the prompt's audio, or to its text as UTF-8).
    input_streaming: bool = False


class FrontOpened(_Tagged):
    """Head -> API server: the request started (``error`` None) or was refused."""

    request_id: str
    error: ErrorInfo | None = None


class FrontDone(_Tagged):
    """Head -> API server, after the request's last OutputChunk (or instead of more)."""

    request_id: str
    usage: dict[str, int]
    error: ErrorInfo | None = None


class FrontClose(_Tagged):
    """API server -> head: the client is gone; abort what is unfinished."""

    request_id: str


class FrontInput(_Tagged):
    """API server -> head: the next piece of a streamed input (``OutputStream.feed``)."""

    request_id: str
    data: bytes
    last: bool = False


class RealtimeSnapshot(msgspec.Struct, array_like=True):
    """One API server's live voice sessions (``realtime.stats.RealtimeStats``), or the sum
    of every server's: counters since it started, and the histogram of the seconds from
    the end of a user's speech to the first answer audio sent, ``first_audio_counts[i]``
    over ``(bounds[i-1], bounds[i]]`` with one more slot for the values above the last."""

    live_sessions: int = 0
    sessions_total: int = 0
    turns_total: int = 0
    barge_ins_total: int = 0
    bounds: tuple[float, ...] = ()
    first_audio_counts: list[int] = []
    first_audio_sum: float = 0.0


class FrontQuery(_Tagged):
    """API server -> head, every refresh interval: my HTTP response counts and live voice
    sessions; your state."""

    server: int
    responses: dict[int, int]
    realtime: RealtimeSnapshot | None = None


class RequestCounts(msgspec.Struct, array_like=True, frozen=True):
    """The orchestrator's request counters."""

    started_total: int
    in_flight: int
    retried_total: int
    direct_edges_total: int = 0
    forwarded_chunks_total: int = 0


class ReplicaStats(msgspec.Struct, array_like=True, frozen=True):
    """One replica's load as the head's pool sees it (``/metrics``)."""

    stage_id: int
    replica_id: int
    up: bool
    in_flight: int
    capacity: int
    queue_length: int
    dispatched_total: int
    # Where it runs when the backend placed it (a Ray node id); None: not known.
    node: str | None = None


class FrontSnapshot(_Tagged):
    """Head -> API server: what the non-generation routes show (health, status,
    metrics), as of now. ``responses`` are every API server's last reported counts.

    The coordinator's table rows (``control.replica_table.ReplicaEntry``) and the latency
    histograms (``dataplane.latency.LatencySnapshot``) travel JSON-encoded: their types
    belong to the roles that keep them, which this module does not import. ``status_json``
    is the ``GET /v1/omni/stages`` body itself."""

    missing: list[tuple[int, str]]
    status_json: bytes
    counts: RequestCounts
    entries_json: bytes
    loads: list[ReplicaStats]
    waiting: dict[int, int]
    responses: dict[int, dict[int, int]]
    # ``dataplane.latency.LatencySnapshot`` as JSON; empty from a head without it.
    latency_json: bytes = b""
    # Every API server's last reported live voice sessions, by server index.
    realtime: dict[int, RealtimeSnapshot] = {}


# The tag of each message type. Tags are part of the wire format: never reuse one.
TAGS: dict[type[msgspec.Struct], bytes] = {
    Hello: b"H",
    HandshakeInit: b"I",
    Ready: b"R",
    AddRequest: b"A",
    # b"C" was the old InputChunk (upstream outputs are OutputChunks now): never reuse it.
    InputChunk: b"c",
    Abort: b"X",
    Shutdown: b"S",
    Ping: b"P",
    OutputChunk: b"O",
    Heartbeat: b"B",
    HeartbeatAck: b"K",
    PipelineRequest: b"a",
    FrontOpened: b"o",
    FrontDone: b"d",
    FrontClose: b"x",
    FrontQuery: b"q",
    FrontInput: b"i",
    FrontSnapshot: b"s",
}

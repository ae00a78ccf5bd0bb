"""The messages between the head and its replicas, as typed msgspec Structs (those
between the head and its API server processes are in ``front``).

Two families:
- Registration (replica DEALER -> master ROUTER, ``protocol.registration``) is one
  msgpack *map* each way with the seed's keys.
- Everything else travels as two frames ``[tag, body]``: a one-byte type tag and the
  msgpack body of the Struct bound to that tag (``tags``, ``codec``). Bodies are array-like
  structs: compact, and fast to encode on the hot path.
"""

from __future__ import annotations

from typing import Any

import msgspec

from omnistage.protocol.chunk_meta import ChunkMeta, TensorMeta
from omnistage.protocol.enums import (
    ErrorKind,
    FinishReason,
    Modality,
    Reason,
    ReplicaState,
)
from omnistage.protocol.params import StageParams

__all__ = ["Reason", "ReplicaState"]  # re-exported: they were declared here first

# Raised with every change to a message's wire shape: registration and the handshake
# refuse a replica that states another version.
PROTOCOL_VERSION = 6


def routing_id(stage_id: int, replica_id: int, epoch: int) -> bytes:
    """A replica incarnation's routing id on the head's input socket."""
    return f"{stage_id}.{replica_id}.{epoch}".encode()


# --------------------------------------------------------------------------------------
# Tagged messages (two frames: tag, body)
# --------------------------------------------------------------------------------------


class Tagged(msgspec.Struct, array_like=True, omit_defaults=False):
    """A message that travels as ``[tag, body]`` (its tag: ``tags.TAGS``)."""


class Hello(Tagged):
    """Replica -> head handshake socket: 'I registered as (stage, replica, epoch)'."""

    stage_id: int
    replica_id: int
    epoch: int
    pid: int
    host: str
    protocol_version: int = PROTOCOL_VERSION


class HandshakeInit(Tagged):
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
    # The fleet's heads (each master's ``tcp://HOST:PORT``, this head first) when this head
    # serves with others (--omni-join); empty when it is alone. The replica registers
    # with each of them too (``HeadAnnounce``).
    heads: list[str] = []


class Ready(Tagged):
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
    # What the engine computes on, e.g. the thinker's "int4-avx512vnni", "int4-avx2" or
    # "torch" (Engine.kernel); empty where the engine does not say.
    kernel: str = ""
    # Which shared memory this replica sees (``connectors.shm.host_key``): two replicas
    # with the same key can hand tensors over in it; "" when it has none.
    host_key: str = ""


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


class Prompt(Tagged):
    """Client input: chat messages or plain text, and audio to listen to (the bytes of
    an uploaded file, e.g. WAV or MP3, decoded by the stage that reads it)."""

    text: str | None = None
    messages: list[ChatMessage] | None = None
    audio: bytes | None = None
    audio_format: str | None = None  # the client's hint ("wav", "mp3", ...), if any
    # The rate of raw ``audio_format="pcm16"`` audio (little-endian int16 mono), which
    # carries no header to say it.
    sample_rate: int | None = None
    # Images to start from (image edits, image-to-video): encoded files (PNG, JPEG,
    # WebP) as the client sent them, decoded by the stage that reads them. ``mask``:
    # where an edit may paint (its fully transparent pixels, as OpenAI's mask means it).
    images: list[bytes] | None = None
    mask: bytes | None = None
    # Videos to watch (an omni thinker): encoded files (MP4, WebM, ...) as sent.
    videos: list[bytes] | None = None
    # Whether the videos' own audio tracks are heard too (``use_audio_in_video``).
    audio_in_video: bool = False

    def modalities(self) -> frozenset[str]:
        has_text = self.text is not None or self.messages is not None
        if self.audio is None:
            found = _TEXT if has_text else frozenset()
        else:
            found = _TEXT_AUDIO if has_text else _AUDIO
        found = found | _IMAGE if self.images else found
        return found | _VIDEO if self.videos else found


_TEXT, _AUDIO = frozenset({Modality.TEXT}), frozenset({Modality.AUDIO})
_TEXT_AUDIO = _TEXT | _AUDIO
_IMAGE, _VIDEO = frozenset({Modality.IMAGE}), frozenset({Modality.VIDEO})


class Resume(Tagged):
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


class PeerConnector(msgspec.Struct, array_like=True, frozen=True):
    """How a replica hands a stage's tensor payloads to one downstream peer: the
    connector's ``name`` ("zmq": inline in the chunk; "shm": shared memory) and its
    ``options`` as the edge's ``connector_config`` gives them."""

    name: str = "zmq"
    options: dict[str, Any] = {}


class AddRequest(Tagged):
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
    # One per ``peers`` entry: the connector its tensor payloads take (missing: zmq).
    connectors: list[PeerConnector] = []
    # A final stage with peers (``head_all``): its tensor chunks (``is_tensor``) go to the peers
    # only, never through the head; and the replica keeps what it sent them until the
    # head ends the request (Abort), to send it again to a replacement peer (Redirect).
    peer_tensors: bool = False


class Redirect(Tagged):
    """Head -> replica: a request's downstream replica was replaced (the stage runs again
    as ``attempt`` elsewhere); this stage keeps running. The replica stops sending to the
    peers in ``gone``, sends the new ``peers`` (``connectors``: one each, as in
    AddRequest) everything it kept for them (``AddRequest.peer_tensors``) stamped with
    ``attempt``, then the rest of the request's outputs as they come. A replica that kept
    nothing for the request (dropped: ``MAX_KEPT``; or a new incarnation) answers with an
    error chunk of kind NOT_KEPT stamped with ``attempt``: the head runs the stage again
    with the new replicas, resuming after the text the client has."""

    request_id: str
    attempt: int
    peers: list[str]
    connectors: list[PeerConnector]
    gone: list[str] = []


class InputChunk(Tagged):
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


class Abort(Tagged):
    request_id: str


class Shutdown(Tagged):
    reason: str


class HeadProbe(Tagged):
    """Replica -> master, while the head leaves its heartbeats unanswered: which head
    answers at the master's address now? A head killed and started again binds the
    same -oma:-omp but new coordinator ports, so the replica's beats go nowhere; the
    probe lets it see the new head within a heartbeat interval of its start, instead of
    waiting out ``lost_after_s``."""

    stage_id: int
    replica_id: int


class HeadProbeReply(Tagged):
    """Master -> replica: the instance id of the head now listening (a replica
    registered with another instance registers again at once)."""

    head_instance: str


class HeadAnnounce(Tagged):
    """Head -> another head's master, every heartbeat interval: "I am a head of your
    fleet, here is my master, and the heads I know". The first one is --omni-join; the
    rest keep the fleet's view of its heads whole and alive (gossip, no leader)."""

    master: str  # tcp://HOST:PORT, where replicas register with the sender
    instance: str
    heads: list[str]


class HeadAnnounceReply(Tagged):
    """Master -> announcing head: this head's master, instance and the heads it knows."""

    master: str
    instance: str
    heads: list[str]


class Ping(Tagged):
    """Head -> replica, ignored by the replica: a send that fails (ROUTER_MANDATORY)
    proves the replica's connection is gone."""


class Usage(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Tokens read and written: one stage's so far (on its chunks), or a request's (the
    sum the API reports, OpenAI's ``usage``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Of ``prompt_tokens``, those whose KV a prefix cache held. None where the engine
    # keeps no prefix cache: the API then leaves out ``prompt_tokens_details``.
    cached_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class PayloadRef(msgspec.Struct, array_like=True, frozen=True):
    """Where a chunk's ``data`` is when a connector moved it outside the message: the
    ``connector`` that holds it, its ``key`` there (a shared-memory segment's name), the
    ``offset`` and ``nbytes`` of the bytes. Only on the peer path: the receiving replica
    puts the bytes back into ``data`` before its engine sees the chunk."""

    connector: str
    key: str
    offset: int
    nbytes: int


class OutputChunk(Tagged):
    """One piece of a stage's output for a request: the one chunk type end to end.

    A replica makes it once from what its engine yields; the same message then goes to
    the head (which hands it to the API as is), and to the replicas of downstream
    stages, straight or through the head, whose engines read it as their input.

    ``modality`` TOOL_CALL: ``text`` is the next piece of a function call's JSON
    arguments and ``meta`` (a ``ToolCallMeta``) says which call.
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
    usage: Usage | None = None
    meta: ChunkMeta | None = None
    # With ``error``: BAD_REQUEST when the input cannot be served (a 4xx for the
    # client, e.g. a prompt longer than the context window), else a server fault.
    error_kind: ErrorKind | None = None
    error_param: str | None = None
    attempt: int = 0
    error_code: str | None = None  # with BAD_REQUEST: OpenAI's error code
    # The tokens behind ``text``, when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    # Set (and ``data`` empty) when a connector carries the bytes (``PayloadRef``).
    ref: PayloadRef | None = None


def is_tensor(chunk: OutputChunk) -> bool:
    """A chunk that carries a tensor for the next stage: TENSOR modality, or a tensor's
    meta on a chunk of the stage's own modality (the echo engine's)."""
    return chunk.modality == Modality.TENSOR or isinstance(chunk.meta, TensorMeta)


class Heartbeat(Tagged):
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
    # The prefix keys (protocol/prefix.py) the engine's prefix cache holds, most recently
    # used first, at most MAX_REPORTED; None: unchanged since the last heartbeat that
    # carried them (or the engine keeps no prefix cache). The head replaces its view.
    cached_prefixes: list[int] | None = None
    # Requests the replica holds for the fleet's other heads (0 with one head): each
    # head counts these against the replica's capacity, so heads do not overload it.
    others: int = 0


class HeartbeatAck(Tagged):
    """Coordinator -> replica, for each heartbeat: what the head thinks of the sender.

    ``state`` is the replica's state in the head's table, or UNKNOWN when the head
    has no such incarnation (it restarted, or a newer registration replaced this one).
    A replica told UNKNOWN or ERROR, or told nothing for long enough, registers again
    (keeping its loaded engine): the head restarted, or it will not route to us.
    """

    state: ReplicaState
    head_instance: str
    # As ``HandshakeInit.heads``, now: how a replica learns of heads that join later.
    heads: list[str] = []

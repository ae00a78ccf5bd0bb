"""Messages between an API server process and the head (``--api-server-count`` > 1, a
private ipc socket on the head's host), and ``PipelineRequest``, what the API asks the
head to run (in the head's own API too). Tagged as ``messages`` (see ``tags``)."""

from __future__ import annotations

import msgspec

from omnistage.protocol.messages import Prompt, Tagged, Usage
from omnistage.protocol.params import StageParams

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


class PipelineRequest(Tagged):
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


class FrontOpened(Tagged):
    """Head -> API server: the request started (``error`` None) or was refused."""

    request_id: str
    error: ErrorInfo | None = None


class FrontDone(Tagged):
    """Head -> API server, after the request's last OutputChunk (or instead of more)."""

    request_id: str
    usage: Usage
    error: ErrorInfo | None = None


class FrontClose(Tagged):
    """API server -> head: the client is gone; abort what is unfinished."""

    request_id: str


class FrontInput(Tagged):
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


class FrontQuery(Tagged):
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
    busy_total: int = 0
    # TENSOR-modality chunks (and their payload bytes) the head passed on between stages:
    # none where every tensor edge is direct.
    forwarded_tensor_chunks_total: int = 0
    forwarded_tensor_bytes_total: int = 0
    # Replacements of a downstream replica fed again by the stage before it (Redirect)
    # instead of running that stage again.
    redirects_total: int = 0


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
    # Prompt tokens of the requests it finished, and of those its prefix cache had.
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0


class FrontSnapshot(Tagged):
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

"""The closed sets of names that cross roles: replica states and why they change,
modalities, finish reasons, error kinds, engine names, trace outcomes.

All are ``StrEnum``: a member *is* its string, so they encode on the wire and in JSON as
the text they always had, and code compares members, never the text.

On Python 3.11 a member lookup (``Modality.TEXT``) costs ~70 ns, ten times a module
global's (``EnumType`` defines ``__getattr__``, which slows every class attribute), so
code that runs for every output chunk binds the members it compares against to module
globals once.
"""

from __future__ import annotations

import enum


class ReplicaState(enum.StrEnum):
    """A replica's state in the head's table, as heartbeats, acks and the API show it.

    STARTING (registered, engine loading) -> UP (READY received, taking traffic) ->
    DRAINING (finishing its requests, taking no new ones) -> DOWN (said goodbye); or
    ERROR (silent, stalled, failed or exited). UNKNOWN appears only in a HeartbeatAck:
    the head has no such incarnation.
    """

    STARTING = "STARTING"
    UP = "UP"
    DRAINING = "DRAINING"
    DOWN = "DOWN"
    ERROR = "ERROR"
    UNKNOWN = "UNKNOWN"


class Reason(enum.StrEnum):
    """Why a replica changed state. The values are what operators read (logs, the API);
    code compares the members, never the text."""

    NONE = ""
    READY = "ready"
    REPLACED = "replaced by a new registration"
    SHUT_DOWN = "replica shut down"
    DRAINING = "draining before shutdown"
    HEARTBEATS_RESUMED = "heartbeats resumed"
    # -> DOWN: the same replica process registered again under another id (its id was
    # taken at another head of the fleet).
    MOVED = "registered again under another id"
    # Failures (-> ERROR). Only HEARTBEAT_TIMEOUT is forgiven when heartbeats return.
    HEARTBEAT_TIMEOUT = "no heartbeat within --omni-heartbeat-timeout"
    STALLED = "engine made no progress with work in hand within --omni-stall-timeout"
    START_TIMEOUT = "no READY within --stage-init-timeout"
    PROCESS_EXITED = "local process exited"
    UNREACHABLE = "its connection closed (unreachable on input)"
    ACTOR_DIED = "replica actor died"


class Modality(enum.StrEnum):
    """What one output chunk carries. TOOL_CALL: ``text`` is the next piece of a function
    call's JSON arguments (its ``ToolCallMeta`` says which call)."""

    TEXT = "text"
    AUDIO = "audio"
    IMAGE = "image"
    VIDEO = "video"
    TOOL_CALL = "tool_call"
    # ``data`` is a tensor for the next stage (its ``TensorMeta`` says which); never
    # shown to a client.
    TENSOR = "tensor"


class FinishReason(enum.StrEnum):
    """Why a stage's output ended, with OpenAI's names."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    ERROR = "error"  # the stage failed (the chunk carries the error)


class ErrorKind(enum.StrEnum):
    """Whose fault an error chunk is: BAD_REQUEST is the client's (a 4xx, e.g. a prompt
    longer than the context window); SERVER is ours; BUSY is nobody's (see below)."""

    BAD_REQUEST = "bad_request"
    SERVER = "server"
    # The replica is full with other heads' requests (several heads share it): the
    # head dispatches the request again, elsewhere or later; not a failure.
    BUSY = "busy"
    # The answer to a Redirect from a replica that kept nothing for the request: the
    # head runs that stage again (with resume) to feed the new downstream replicas.
    # Never a client's error.
    NOT_KEPT = "not_kept"


class LbPolicy(enum.StrEnum):
    """How a stage's replicas are balanced (--omni-lb-policy, a stage's ``lb_policy``);
    each has one class in ``control.balancing``."""

    RANDOM = "random"
    ROUND_ROBIN = "round-robin"
    LEAST_QUEUE_LENGTH = "least-queue-length"
    POWER_OF_TWO = "power-of-two"
    CACHE_AWARE = "cache-aware"


class EngineName(enum.StrEnum):
    """The engines a stage can run (``engine:`` in a deploy config)."""

    ECHO = "echo"
    LLM = "llm"
    TTS = "tts"
    ASR = "asr"
    DIFFUSION = "diffusion"
    VLLM = "vllm"
    VIDEO = "video"
    # Qwen2.5-Omni's stages, from transformers' own classes (engines/omni/).
    OMNI_THINKER = "omni-thinker"
    OMNI_TALKER = "omni-talker"
    OMNI_TOKEN2WAV = "omni-token2wav"
    # Qwen3-Omni's (MoE) stages, likewise.
    OMNI3_THINKER = "omni3-thinker"
    OMNI3_TALKER = "omni3-talker"
    OMNI3_CODE2WAV = "omni3-code2wav"


class Outcome(enum.StrEnum):
    """How a traced request, stage dispatch or replica generation ended."""

    DERIVE = ""  # "from how the run stands": ok, error or cancelled
    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"
    ABORTED = "aborted"
    BAD_REQUEST = "bad_request"  # a replica refused the request's params
    REJECTED = "rejected"
    REPLICA_LOST = "replica lost"
    RESTARTED = "restarted"

"""The engine interface: what a replica runs for its stage.

start -> generate (one async iterator per request) -> shutdown. Abort is cancellation:
the runtime cancels the task iterating ``generate``, and an engine must free the
request's resources when that happens (``finally`` blocks, cancelled futures).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from omnistage.config.schema import StageConfig
from omnistage.protocol.chunk_meta import ChunkMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.messages import OutputChunk, Prompt, TokenLogprob, Usage
from omnistage.protocol.params import StageParams

# An upstream stage's output, read as this stage's input: the same message the upstream
# replica sent (``stage_id`` is the stage it came from).
StageInput = OutputChunk


def stage_input(
    source_stage: int,
    text: str = "",
    modality: Modality = Modality.TEXT,
    data: bytes = b"",
    meta: ChunkMeta | None = None,
) -> StageInput:
    """An input chunk made by hand (tests, benchmarks, direct engine use)."""
    return OutputChunk("", source_stage, 0, 0, 0, modality, text, data, meta=meta)


@dataclass
class EngineRequest:
    request_id: str
    prompt: Prompt | None
    params: StageParams
    # Upstream chunks as they arrive; ends when every upstream stage has finished.
    inputs: AsyncIterator[StageInput]
    # On a retry after a replica failure, for engines with ``supports_resume``: the
    # text this stage already delivered. Generate what follows it, not it again.
    resume_text: str = ""
    # The completion tokens behind ``resume_text`` as first counted (0: unknown).
    resume_tokens: int = 0
    # A streamed input (``PipelineRequest.input_streaming``), for engines with
    # ``streams_input``: its pieces as they arrive, the prompt's own (audio, or text as
    # UTF-8) first, ending after the last; None when the prompt is the whole input.
    # Other engines get the pieces joined into ``prompt`` once the input has ended.
    prompt_chunks: AsyncIterator[bytes] | None = None


@dataclass
class EngineChunk:
    modality: Modality
    text: str = ""
    data: bytes = b""
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    meta: ChunkMeta | None = None
    logprobs: list[TokenLogprob] | None = None


class Engine(abc.ABC):
    # True if ``generate`` honours ``EngineRequest.resume_text`` (continues after it).
    # Other engines are simply run again on a retry and the runtime drops the output
    # the client already has, which is right only for a deterministic engine.
    supports_resume = False
    # True if ``generate`` reads ``EngineRequest.prompt_chunks`` as they arrive.
    streams_input = False

    def __init__(self, stage: StageConfig) -> None:
        self.stage = stage
        # Bumped on every unit of work done (decode step, chunk); heartbeats report it
        # so the head can tell a stalled engine from a merely busy one.
        self.progress = 0
        # What ``start`` is doing right now (shown as the replica's STARTING detail in
        # /v1/omni/stages and on the dashboard); engines with long starts update it.
        self.starting = ""
        # What it computes on, once started (Ready.kernel: shown per replica in
        # /v1/omni/stages and on the dashboard); empty where there is nothing to say.
        self.kernel = ""

    @property
    def name(self) -> str:
        return self.stage.engine

    @property
    def capacity(self) -> int:
        """How many requests this engine works on at once."""
        return self.stage.max_inflight_per_replica

    @property
    def queue_length(self) -> int:
        """Requests accepted but not yet being worked on."""
        return 0

    def cached_prefixes(self) -> tuple[int, tuple[int, ...]] | None:
        """The prefix keys (protocol/prefix.py) this engine's prefix cache holds, most
        recently used first, with a version that changes whenever they do; None if it
        keeps no prefix cache. Read from the heartbeat thread: return a snapshot."""
        return None

    def check(self, params: StageParams) -> None:  # noqa: B027 - optional hook
        """Raise BadRequestError for request params this engine cannot serve, before
        any work (a stream's status line waits for it; see ``AddRequest.ack``)."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load weights; may take long (bounded by --stage-init-timeout)."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Stream the output for one request; the last chunk has ``finished=True``."""

    async def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""


def prompt_text(prompt: Prompt | None) -> str:
    """The text a text-in engine should read from a client prompt."""
    if prompt is None:
        return ""
    if prompt.text is not None:
        return prompt.text
    for message in reversed(prompt.messages or []):
        if message.role == "user":
            return message.content
    return ""


async def joined_prompt(prompt: Prompt, pieces: AsyncIterator[bytes]) -> Prompt:
    """A streamed input as one prompt, once its last piece has arrived: the pieces (the
    prompt's own first) as its audio, or as its text when it has no audio."""
    data = b"".join([piece async for piece in pieces])
    if prompt.audio is not None:
        return msgspec.structs.replace(prompt, audio=data)
    return msgspec.structs.replace(prompt, text=data.decode("utf-8", errors="replace"))

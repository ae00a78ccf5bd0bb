"""What an ``OutputChunk``'s text or bytes are (its ``meta``): one Struct per payload kind,
a union told apart on the wire by the tag that leads each one's array."""

from __future__ import annotations

import msgspec


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


class _Meta(msgspec.Struct, array_like=True, frozen=True):
    """What a chunk's bytes or text are: one kind per payload, told apart on the wire by
    the tag that leads its array (``ChunkMeta``)."""


class TextMeta(_Meta, tag="text"):
    """Text of a transcription: ``segment`` (one per chunk), and on the last chunk the
    detected ``language`` and the audio's ``duration`` in seconds."""

    segment: Segment | None = None
    language: str | None = None
    duration: float | None = None


class ToolCallMeta(_Meta, tag="tool_call"):
    """The call a TOOL_CALL chunk's arguments belong to: its ``index`` in the answer."""

    index: int
    name: str


class AudioMeta(_Meta, tag="audio"):
    """Audio bytes: raw little-endian int16 mono at ``sample_rate``."""

    sample_rate: int
    format: str = "pcm16"
    voice: str | None = None


class ImageMeta(_Meta, tag="image"):
    """An image file (``format`` "png", "jpeg", "webp"). ``index``: the image's place
    among the request's images; ``seed``: what drew it. Both None for a video's first
    frame, sent as its thumbnail."""

    format: str
    width: int
    height: int
    seed: int | None = None
    index: int | None = None


class VideoMeta(_Meta, tag="video"):
    """A video file: ``frames`` at ``fps``, drawn from ``seed``."""

    width: int
    height: int
    frames: int
    fps: int
    seed: int
    format: str = "mp4"


class ProgressMeta(_Meta, tag="progress"):
    """A chunk without data from an image or video stage: ``step`` of ``steps`` done,
    of the request's image ``index`` (None for a video)."""

    step: int
    steps: int
    index: int | None = None


class TensorMeta(_Meta, tag="tensor"):
    """A tensor in the chunk's bytes (C order), e.g. one stage's ``hidden_states`` for the
    next: its ``dtype`` as torch and numpy name it ("float16", "bfloat16") and ``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]


ChunkMeta = TextMeta | ToolCallMeta | AudioMeta | ImageMeta | VideoMeta | ProgressMeta | TensorMeta

"""What a request asks of each kind of engine: the typed contract between API and engines.

The API builds these once per request (from its validated request bodies, or by
``decode`` from the untyped ``stage_params`` extension and a stage's
``default_sampling_params``); the head merges them per stage (``StageParams.merged``) and
sends them in ``AddRequest.params``; each engine reads its own group once (``text``,
``speech``, ``transcription``, ``image`` or ``video``) and ignores the others.

Every field is optional: None means "not asked", and the engine's default applies. The
constraints are declared here, on the fields, so a bad value is refused by ``decode``
with the field's name (the ``param`` of the 400), whoever sent it. Engines check only
what depends on their own state (the context window, a voice they have, a size limit).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import msgspec

from omnistage.protocol.enums import EngineName
from omnistage.protocol.errors import BadRequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# OpenAI's limits on top_logprobs (chat) and logprobs (completions).
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_STOP_SEQUENCES = 4
MAX_REPETITION_PENALTY = 10.0  # far past any useful value; bounds what a request can ask
# Images one request may ask for (OpenAI's own limit for ``n``).
MAX_IMAGES = 10
MAX_STEPS = 1000  # schedulers are trained on 1000 timesteps; more cannot be scheduled
MAX_GUIDANCE = 100.0
SEED_LIMIT = 2**63  # image seeds are 0 .. 2**63 - 1; image i of a request uses seed + i
MAX_NEGATIVE_PROMPT = 4000
IMAGE_FORMATS = ("png", "jpeg", "webp")
MAX_VIDEO_SECONDS = 60.0
MAX_VIDEO_FPS = 60
# A minute at the highest rate: a stage's own ``max_frames`` is usually far lower.
MAX_VIDEO_FRAMES = int(MAX_VIDEO_SECONDS) * MAX_VIDEO_FPS

Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
StopText = Annotated[str, msgspec.Meta(min_length=1)]
StopList = Annotated[list[StopText], msgspec.Meta(max_length=MAX_STOP_SEQUENCES)]
TokenId = Annotated[str, msgspec.Meta(pattern="^[0-9]+$")]  # JSON object keys are text
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_REPETITION_PENALTY)]


class _Params(msgspec.Struct, omit_defaults=True, frozen=True):
    """Map-encoded with unset fields left out: an empty group costs one byte."""

    def merged(self, over: Any) -> Any:
        """These params with every field ``over`` sets taken from it."""
        changes = {f: v for f in over.__struct_fields__ if (v := getattr(over, f)) is not None}
        return msgspec.structs.replace(self, **changes) if changes else self


class GenerationParams(_Params, frozen=True):
    """Text generation (the ``llm``, ``vllm`` and ``echo`` engines): OpenAI's sampling
    fields, vLLM's benchmark extensions, and what only a stage writing the answer takes
    (logprobs, structured output, tools)."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)] | None = None  # 0 or -1: off
    stop: StopText | StopList | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # vLLM's extension (HF's semantics): the logits of tokens already in the prompt or
    # the answer are divided by it (multiplied, when negative); 1: off.
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[TokenId, Bias] | None = None
    # Chat's ``logprobs: true`` with ``top_logprobs: k``, or completions' ``logprobs: k``.
    logprobs: bool | Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # OpenAI's shapes, as the client sent them (a JSON schema is any JSON).
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # vLLM's extension: the last message is left open (rendered without its end and with
    # no assistant turn after it), so the model goes on writing it. A realtime session
    # asks this of the thinker to hear whether a user's words so far end their turn
    # (``realtime.words_turn``).
    continue_final_message: bool | None = None
    # OpenAI's Realtime and Responses ``truncation``: "auto" drops a conversation's
    # oldest exchanges when it no longer fits the context window (engines/llm/truncation).
    truncation: Literal["auto", "disabled"] | None = None


class SpeechParams(_Params, frozen=True):
    """Speech synthesis (the ``tts`` engine)."""

    voice: str | None = None
    speed: Annotated[float, msgspec.Meta(ge=0.25, le=4.0)] | None = None


class TranscriptionParams(_Params, frozen=True):
    """Speech recognition (the ``asr`` engine)."""

    language: str | None = None
    prompt: str | None = None
    # The first of faster-whisper's fallback temperatures (it climbs from there).
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None


class ImageParams(_Params, frozen=True):
    """Image generation (the ``diffusion`` engine). ``size`` is ``"WIDTHxHEIGHT"`` or
    ``"auto"``; its limits depend on the stage (``engines.image_params.image_job``)."""

    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_IMAGES)] | None = None
    size: str | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=SEED_LIMIT - 1)] | None = None
    num_inference_steps: Annotated[int, msgspec.Meta(ge=1, le=MAX_STEPS)] | None = None
    guidance_scale: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_GUIDANCE)] | None = None
    negative_prompt: Annotated[str, msgspec.Meta(max_length=MAX_NEGATIVE_PROMPT)] | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    output_compression: Annotated[int, msgspec.Meta(ge=0, le=100)] | None = None
    progress: bool | None = None  # stream a progress chunk after every denoising step
    # Image edits: how far the source image is noised before denoising (0 keeps it, 1
    # draws anew); None: the pipeline's own default. Ignored without a source image.
    strength: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None


class VideoParams(_Params, frozen=True):
    """Video generation (the ``video`` engine). The length is ``num_frames`` when given,
    else ``seconds * fps``; ``size`` is ``"WIDTHxHEIGHT"`` or ``"auto"``. The limits that
    depend on the stage (size, frames) are checked by ``engines.video_params.video_job``."""

    seconds: Annotated[float, msgspec.Meta(gt=0.0, le=MAX_VIDEO_SECONDS)] | None = None
    size: str | None = None
    fps: Annotated[int, msgspec.Meta(ge=1, le=MAX_VIDEO_FPS)] | None = None
    num_frames: Annotated[int, msgspec.Meta(ge=1, le=MAX_VIDEO_FRAMES)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=SEED_LIMIT - 1)] | None = None
    num_inference_steps: Annotated[int, msgspec.Meta(ge=1, le=MAX_STEPS)] | None = None
    guidance_scale: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_GUIDANCE)] | None = None
    negative_prompt: Annotated[str, msgspec.Meta(max_length=MAX_NEGATIVE_PROMPT)] | None = None
    progress: bool | None = None  # stream a progress chunk after every denoising step


class ParamKind(enum.StrEnum):
    """Which group of ``StageParams`` a stage's engine reads."""

    TEXT = "text"
    SPEECH = "speech"
    TRANSCRIPTION = "transcription"
    IMAGE = "image"
    VIDEO = "video"


PARAM_KIND = {
    EngineName.ECHO: ParamKind.TEXT,
    EngineName.LLM: ParamKind.TEXT,
    EngineName.VLLM: ParamKind.TEXT,
    EngineName.TTS: ParamKind.SPEECH,
    EngineName.ASR: ParamKind.TRANSCRIPTION,
    EngineName.DIFFUSION: ParamKind.IMAGE,
    EngineName.VIDEO: ParamKind.VIDEO,
    EngineName.OMNI_THINKER: ParamKind.TEXT,
    EngineName.OMNI_TALKER: ParamKind.SPEECH,
    EngineName.OMNI_TOKEN2WAV: ParamKind.SPEECH,
    EngineName.OMNI3_THINKER: ParamKind.TEXT,
    EngineName.OMNI3_TALKER: ParamKind.SPEECH,
    EngineName.OMNI3_CODE2WAV: ParamKind.SPEECH,
}
_GROUP_TYPE: dict[ParamKind, type[_Params]] = {
    ParamKind.TEXT: GenerationParams,
    ParamKind.SPEECH: SpeechParams,
    ParamKind.TRANSCRIPTION: TranscriptionParams,
    ParamKind.IMAGE: ImageParams,
    ParamKind.VIDEO: VideoParams,
}

_NO_TEXT, _NO_SPEECH = GenerationParams(), SpeechParams()
_NO_TRANSCRIPTION, _NO_IMAGE = TranscriptionParams(), ImageParams()
_NO_VIDEO = VideoParams()


class StageParams(msgspec.Struct, omit_defaults=True, frozen=True):
    """The params of one request at one stage: a group per kind of engine. A request's
    params for every stage are one of these too (chat's sampling fields in ``text`` go
    to each stage; a ``tts`` stage reads only ``speech``)."""

    text: GenerationParams | None = None
    speech: SpeechParams | None = None
    transcription: TranscriptionParams | None = None
    image: ImageParams | None = None
    video: VideoParams | None = None

    @property
    def empty(self) -> bool:
        return self == _EMPTY

    # The groups as their engines read them: never None.
    @property
    def generation(self) -> GenerationParams:
        return self.text or _NO_TEXT

    @property
    def speaking(self) -> SpeechParams:
        return self.speech or _NO_SPEECH

    @property
    def transcribing(self) -> TranscriptionParams:
        return self.transcription or _NO_TRANSCRIPTION

    @property
    def imaging(self) -> ImageParams:
        return self.image or _NO_IMAGE

    @property
    def filming(self) -> VideoParams:
        return self.video or _NO_VIDEO

    def merged(self, over: StageParams | None) -> StageParams:
        """These params with what ``over`` sets taken from it, field by field."""
        if over is None or over.empty:
            return self
        if self.empty:
            return over
        groups = {}
        for name in self.__struct_fields__:
            mine, theirs = getattr(self, name), getattr(over, name)
            groups[name] = theirs if mine is None else mine.merged(theirs) if theirs else mine
        return StageParams(**groups)


_EMPTY = NO_PARAMS = StageParams()


def kind_of(engine: str) -> ParamKind:
    """The params group an engine reads (a name from ``EngineName``)."""
    return PARAM_KIND[EngineName(engine)]


def decode(kind: ParamKind, raw: dict[str, Any]) -> StageParams:
    """Untyped params (a request's ``stage_params`` entry, a stage's
    ``default_sampling_params``) as the group ``kind``; keys the group does not have are
    ignored (a pipeline's stages each take their own). A bad value is a BadRequestError
    naming the field."""
    if not raw:
        return _EMPTY
    try:
        group = msgspec.convert(raw, _GROUP_TYPE[kind])
    except msgspec.ValidationError as exc:
        field = _field_of(exc)
        why = str(exc).rpartition(" - at `")[0] or str(exc)
        raise BadRequestError(f"{field}: {why}" if field else why, field) from None
    if group == _GROUP_TYPE[kind]():
        return _EMPTY  # nothing this kind reads: empty, as every other unset group
    return StageParams(**{kind.value: group})


def _field_of(exc: msgspec.ValidationError) -> str | None:
    """The top-level field msgspec's message points at (``... - at `$.max_tokens[0]```)."""
    _, _, path = str(exc).rpartition("`$.")
    name = path.split("`")[0].split("[")[0].split(".")[0]
    return name or None

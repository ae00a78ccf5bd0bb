"""The form of POST /v1/audio/transcriptions (multipart: the file and these fields)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from omnistage.api.schemas.base import Body
from omnistage.api.transcripts import TRANSCRIPT_FORMATS
from omnistage.protocol.params import StageParams, TranscriptionParams


class TranscriptionForm(Body):
    """The form's fields other than the file (unknown ones are ignored)."""

    model: str | None = None
    language: str | None = Field(default=None, max_length=32)
    prompt: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    response_format: Literal["json", "text", "srt", "vtt", "verbose_json"] = "json"
    stream: bool = False
    # omnistage extension: which ASR stage transcribes (id or name), when there are several.
    stage: str | None = None

    def asr_params(self) -> StageParams:
        """The ASR stage's params: the fields given of language, prompt, temperature."""
        asr = TranscriptionParams(self.language, self.prompt, self.temperature)
        return StageParams(transcription=asr)


# The form as /openapi.json describes it (form fields are strings, never null).
_FORM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["file"],
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "the audio file"},
        "model": {"type": "string"},
        "language": {"type": "string", "description": "ISO-639-1 code, e.g. en"},
        "prompt": {"type": "string", "description": "text to continue (Whisper's prompt)"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "response_format": {
            "type": "string",
            "enum": list(TRANSCRIPT_FORMATS),
            "default": "json",
        },
        "stream": {"type": "boolean", "default": False},
        "timestamp_granularities[]": {
            "type": "array",
            "items": {"type": "string", "enum": ["segment"]},
        },
        "stage": {"type": "string", "description": "omnistage: the ASR stage, id or name"},
    },
}
FORM_DOC = {
    "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _FORM_SCHEMA}}}
}

"""A transcription in OpenAI's response formats: json, text, srt, vtt, verbose_json.

Pure functions over the segments an ASR stage reports (see engines/asr.py), so the
shapes are testable without a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from omnistage.protocol.chunk_meta import Segment

TRANSCRIPT_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
STREAMABLE_FORMATS = ("json", "text")
MEDIA_TYPES = {
    "json": "application/json",
    "verbose_json": "application/json",
    "text": "text/plain; charset=utf-8",
    "srt": "text/plain; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
}

# verbose_json names the language as Whisper does ("english"), not by its code.
_WHISPER_LANGUAGES = (
    "en:english zh:chinese de:german es:spanish ru:russian ko:korean fr:french "
    "ja:japanese pt:portuguese tr:turkish pl:polish ca:catalan nl:dutch ar:arabic "
    "sv:swedish it:italian id:indonesian hi:hindi fi:finnish vi:vietnamese he:hebrew "
    "uk:ukrainian el:greek ms:malay cs:czech ro:romanian da:danish hu:hungarian "
    "ta:tamil no:norwegian th:thai ur:urdu hr:croatian bg:bulgarian lt:lithuanian "
    "la:latin mi:maori ml:malayalam cy:welsh sk:slovak te:telugu fa:persian "
    "lv:latvian bn:bengali sr:serbian az:azerbaijani sl:slovenian kn:kannada "
    "et:estonian mk:macedonian br:breton eu:basque is:icelandic hy:armenian "
    "ne:nepali mn:mongolian bs:bosnian kk:kazakh sq:albanian sw:swahili gl:galician "
    "mr:marathi pa:punjabi si:sinhala km:khmer sn:shona yo:yoruba so:somali "
    "af:afrikaans oc:occitan ka:georgian be:belarusian tg:tajik sd:sindhi "
    "gu:gujarati am:amharic yi:yiddish lo:lao uz:uzbek fo:faroese ht:haitian_creole "
    "ps:pashto tk:turkmen nn:nynorsk mt:maltese sa:sanskrit lb:luxembourgish "
    "my:myanmar bo:tibetan tl:tagalog mg:malagasy as:assamese tt:tatar haw:hawaiian "
    "ln:lingala ha:hausa ba:bashkir jw:javanese su:sundanese yue:cantonese"
)
_LANGUAGE_NAMES = dict(pair.replace("_", " ").split(":") for pair in _WHISPER_LANGUAGES.split())


@dataclass(frozen=True)
class Transcript:
    segments: list[Segment]
    language: str  # a code, "en"
    duration: float  # seconds of audio

    @property
    def text(self) -> str:
        # Whisper starts each segment's text with a space.
        return "".join(s.text for s in self.segments).strip()

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage of a model billed by audio duration (whisper-1)."""
        return {"type": "duration", "seconds": self.duration}


def render(transcript: Transcript, fmt: str) -> str | dict[str, Any]:
    """The response body: a JSON object for json and verbose_json, else text."""
    if fmt == "json":
        return {"text": transcript.text, "usage": transcript.usage()}
    if fmt == "verbose_json":
        return verbose_json(transcript)
    if fmt == "text":
        return transcript.text + "\n"
    if fmt == "srt":
        return srt(transcript.segments)
    if fmt == "vtt":
        return vtt(transcript.segments)
    raise ValueError(f"unknown transcript format {fmt!r}")


def verbose_json(transcript: Transcript) -> dict[str, Any]:
    return {
        "task": "transcribe",
        "language": _LANGUAGE_NAMES.get(transcript.language, transcript.language),
        "duration": transcript.duration,
        "text": transcript.text,
        "segments": [msgspec.structs.asdict(s) for s in transcript.segments],
        "usage": transcript.usage(),
    }


def srt(segments: list[Segment]) -> str:
    """SubRip: numbered cues from 1, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, blank-line separated."""
    cues = [
        f"{n}\n{timestamp(s.start, ',')} --> {timestamp(s.end, ',')}\n{s.text.strip()}\n"
        for n, s in enumerate(segments, 1)
    ]
    return "\n".join(cues)


def vtt(segments: list[Segment]) -> str:
    """WebVTT: the ``WEBVTT`` header, then cues ``HH:MM:SS.mmm --> HH:MM:SS.mmm``."""
    cues = [
        f"{timestamp(s.start, '.')} --> {timestamp(s.end, '.')}\n{s.text.strip()}\n"
        for s in segments
    ]
    return "\n".join(["WEBVTT\n", *cues])


def timestamp(seconds: float, decimal_marker: str) -> str:
    """``HH:MM:SS<marker>mmm``, rounded to the millisecond (negative reads as zero)."""
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{ms:03d}"

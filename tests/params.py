"""Request params in tests as the API makes them: a plain dict decoded as the group one
kind of engine reads (``protocol.params.decode``: a bad value raises BadRequestError
naming the field, as the API's 400 would)."""

from __future__ import annotations

from typing import Any

from omnistage.protocol.params import ParamKind, StageParams, decode


def text(raw: dict[str, Any] | None = None, **fields: Any) -> StageParams:
    return decode(ParamKind.TEXT, {**(raw or {}), **fields})


def speech(raw: dict[str, Any] | None = None, **fields: Any) -> StageParams:
    return decode(ParamKind.SPEECH, {**(raw or {}), **fields})


def transcription(raw: dict[str, Any] | None = None, **fields: Any) -> StageParams:
    return decode(ParamKind.TRANSCRIPTION, {**(raw or {}), **fields})


def image(raw: dict[str, Any] | None = None, **fields: Any) -> StageParams:
    return decode(ParamKind.IMAGE, {**(raw or {}), **fields})


def video(raw: dict[str, Any] | None = None, **fields: Any) -> StageParams:
    return decode(ParamKind.VIDEO, {**(raw or {}), **fields})

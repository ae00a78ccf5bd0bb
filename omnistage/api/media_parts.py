"""A chat's image and video parts, and a response's video parts: which ones the served
pipeline takes, and the files they carry (a ``data:`` URL, or an http(s) URL fetched
when the operator allows its host with ``--allowed-media-domains``). Images are
``image_url`` parts (OpenAI's), videos ``video_url`` parts (vLLM's: OpenAI's chat has
none), alike but for the media type. OpenAI's Responses API has no video part either:
its ``input`` takes chat's ``video_url`` part, as vLLM's /v1/responses does (its content
parts go through its chat parser).

A part no stage of the pipeline reads is a 400 naming it (``messages.N.content.M``,
``input.N.content.M``): a silent drop would answer a question about an image without
the image. Only the last user message may carry images and videos, as it alone may carry
audio: the thinker places every media placeholder in that message
(engines/omni/thinker.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from omnistage import defaults
from omnistage.api.schemas.chat import ChatCompletionRequest, ContentPart
from omnistage.api.schemas.responses import ResponsesRequest
from omnistage.dataplane.graph import StageGraph
from omnistage.protocol.enums import Modality
from omnistage.protocol.errors import ApiError

_PARTS = "text, input_audio, image_url and video_url"


@dataclass(frozen=True)
class MediaFetch:
    """What a server fetches for a chat's image URLs: the hosts allowed (``*``: any;
    none: no fetching), how long one fetch may take and how large a file may be."""

    allowed_domains: tuple[str, ...] = ()
    timeout_s: float = defaults.MEDIA_FETCH_TIMEOUT_S
    max_bytes: int = defaults.MEDIA_FETCH_MAX_BYTES

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(d == "*" or host == d.lower().rstrip(".") for d in self.allowed_domains)


# A part's kind -> what it is called in messages, and the media type of its data URLs.
_KINDS = {"image_url": ("image", Modality.IMAGE), "video_url": ("video", Modality.VIDEO)}


def _refused(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", "invalid_request_error", where)


def media_parts(
    body: ChatCompletionRequest, graph: StageGraph, pipeline: str
) -> list[tuple[str, ContentPart]]:
    """The image and video parts (with where each is) after refusing every part the
    pipeline cannot take: unknown kinds, images or videos where no stage reads them or
    not in the last user message."""
    last_user = max((i for i, m in enumerate(body.messages) if m.role == "user"), default=-1)
    found = []
    for i, message in enumerate(body.messages):
        parts = message.content if isinstance(message.content, list) else []
        for j, part in enumerate(parts):
            where = f"messages.{i}.content.{j}"
            if part.type in ("text", "input_audio"):
                continue  # audio has its own checks (api/routes/chat.py)
            if part.type not in _KINDS:
                raise _refused(
                    where, f"content parts of type {part.type!r} are not supported; use {_PARTS}"
                )
            _check_place(where, part.type, graph, pipeline, i == last_user)
            found.append((where, part))
    return found


def response_videos(
    body: ResponsesRequest, graph: StageGraph, pipeline: str
) -> list[tuple[str, str]]:
    """The ``video_url`` parts of a Responses request's own input (where each is, and its
    URL), after refusing those the pipeline cannot take, as chat's. The turns a
    ``previous_response_id`` replays are not in ``body``: their videos are not watched
    again, as their audio is not heard again (api/response_audio.py)."""
    last_user = max((i for i, item in enumerate(body.input) if item.role == "user"), default=-1)
    found = []
    for i, item in enumerate(body.input):
        for j, part in enumerate(item.content or []):
            if part.video_url is None:
                continue
            where = f"input.{i}.content.{j}"
            _check_place(where, part.type, graph, pipeline, i == last_user)
            found.append((where, part.video_url.url))
    return found


def _check_place(where: str, part_type: str, graph: StageGraph, pipeline: str, last: bool) -> None:
    """A 400 naming the part unless a stage reads its kind and it is in the last user
    message."""
    kind, modality = _KINDS[part_type]
    if not graph.stages_reading(modality):
        raise _refused(where, f"pipeline {pipeline!r} has no stage that takes {kind}s")
    if not last:
        raise _refused(where, f"only the last user message may carry {kind}s")


async def media_bytes(
    where: str, part: ContentPart, fetch: MediaFetch, sound: bool = False
) -> bytes:
    """The image or video file a chat's part carries (see ``media_file``)."""
    media = part.image_url if part.type == "image_url" else part.video_url
    assert media is not None
    return await media_file(where, part.type, media.url, fetch, sound)


async def media_file(
    where: str, part_type: str, url: str, fetch: MediaFetch, sound: bool = False
) -> bytes:
    """The image or video file at ``url`` of a part of ``part_type`` (``image_url``,
    ``video_url``), checked to be one Pillow (an image) or PyAV (a video) can open; a
    video with an audio track where ``sound`` (``use_audio_in_video``) asks to hear it."""
    kind = _KINDS[part_type][0]
    if url.startswith("data:"):
        data = _data_url(where, url, kind)
    else:
        data = await asyncio.to_thread(_fetched, where, url, fetch, kind)
    if kind == "image":
        await asyncio.to_thread(_check_image, where, data)
    else:
        await asyncio.to_thread(_check_video, where, data, sound)
    return data


def _data_url(where: str, url: str, kind: str) -> bytes:
    head, comma, payload = url.partition(",")
    example = "data:image/png;base64,..." if kind == "image" else "data:video/mp4;base64,..."
    if not comma or not head.endswith(";base64"):
        raise _refused(where, f"a data URL must be base64: {example}")
    if not head[len("data:") :].startswith(f"{kind}/"):
        raise _refused(where, f"the data URL of this {kind}_url part must hold a {kind}/* type")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _refused(where, "the data URL's payload is not valid base64") from None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    # A redirect could lead to a host the operator did not allow.
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _fetched(where: str, url: str, fetch: MediaFetch, kind: str) -> bytes:
    """The file at an http(s) URL of an allowed host, refused past the size limit."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        message = f"the URL of this {kind}_url part must be a data: URL or an http(s) URL"
        raise _refused(where, message)
    if not fetch.allows(parts.hostname):
        raise _refused(
            where,
            f"this server does not fetch {kind}s from {parts.hostname!r} "
            "(the operator allows hosts with --allowed-media-domains); send a data: URL",
        )
    try:
        with _OPENER.open(url, timeout=fetch.timeout_s) as response:
            data = response.read(fetch.max_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise _refused(where, f"fetching the {kind} answered HTTP {exc.code}") from None
    except (OSError, ValueError) as exc:  # refused, unreachable, timed out, bad URL
        raise _refused(where, f"could not fetch the {kind}: {exc}") from None
    if len(data) > fetch.max_bytes:
        raise _refused(where, f"the {kind} is larger than {fetch.max_bytes} bytes")
    return data


def _check_image(where: str, data: bytes) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError):
        raise _refused(where, "the image cannot be read (PNG, JPEG, WebP, GIF)") from None


def _check_video(where: str, data: bytes, sound: bool) -> None:
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            heard = bool(container.streams.audio)
    except (av.error.FFmpegError, OSError, ValueError):
        raise _refused(where, "the video cannot be read (MP4, WebM, MOV, ...)") from None
    if sound and not heard:
        asks = "mm_processor_kwargs.use_audio_in_video asks to hear"
        raise _refused(where, f"the video has no audio track, which {asks}")

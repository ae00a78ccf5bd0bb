"""POST /v1/images/generations: a prompt in, images out, in OpenAI's shape.

Served by the pipeline's image stage (engine ``diffusion``). The stages in front of it
run too: in the ``painter`` pipeline a thinker first expands the prompt, and what it
wrote comes back as each image's ``revised_prompt`` (``revise_prompt: false`` skips
them and draws the prompt as given). The seed is fixed here, before the request runs
(random unless the client gives one), so a retry on another replica draws the same
images; each image reports its seed. Images come back as ``b64_json`` only: nothing is
stored, so there is no URL to give.

With ``stream: true`` the answer is server-sent events: an ``image_generation.progress``
event (omnistage's) after every denoising step, and OpenAI's
``image_generation.completed`` event per finished image.

The answer's shape (``ImageSink``, ``ImageEvents``) is shared with POST /v1/images/edits.
"""

from __future__ import annotations

import base64
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from omnistage.api.body import parse_body
from omnistage.api.ids import next_id
from omnistage.api.routes.common import (
    ChunkShape,
    check_model,
    collect_into,
    engine_stages,
    json_response,
    peeked,
    pick_stage,
    resolve_stage_params,
    service,
    sse_events,
    sse_response,
)
from omnistage.api.schemas.images import ImageFields, ImageGenerationRequest
from omnistage.api.streaming import sse
from omnistage.config.engine_args import DiffusionArgs
from omnistage.config.schema import StageConfig
from omnistage.protocol.chunk_meta import ImageMeta, ProgressMeta
from omnistage.protocol.enums import EngineName, Modality
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.image_params import image_job
from omnistage.protocol.messages import ChatMessage, OutputChunk, Prompt, Usage
from omnistage.protocol.params import (
    NO_PARAMS,
    SEED_LIMIT,
    GenerationParams,
    ImageParams,
    StageParams,
)
from omnistage.service import OutputStream, PipelineService


async def generations(request: Request) -> Response:
    body = await parse_body(request, ImageGenerationRequest)
    omni = service(request)
    check_model(omni, body.model)
    painter = image_stage(omni, body.stage, "/v1/images/generations")
    seed, image = seeded_params(body, painter)
    writers = _writers(omni, painter) if body.revise_prompt else []
    stage_params = resolve_stage_params(omni, body.stage_params)
    painting = stage_params.get(painter.stage_id, NO_PARAMS)
    stage_params[painter.stage_id] = painting.merged(StageParams(image=image))
    pipeline_request = PipelineRequest(
        f"img-{next_id()}",
        Prompt(messages=[ChatMessage("user", body.prompt)]),
        [*writers, painter.stage_id],
        # The thinker's sampling too: one seed repeats the whole answer.
        StageParams(text=GenerationParams(seed=seed)),
        stage_params,
        only=not body.revise_prompt,
    )
    return await answer(request, omni, pipeline_request, "image_generation", body)


def seeded_params(fields: ImageFields, painter: StageConfig) -> tuple[int, ImageParams]:
    """The seed (fixed here, random unless given, so a retry draws the same images) and
    the image stage's params, checked against its limits: the stage would refuse them
    too, but only after the stages before it had run."""
    seed = fields.seed if fields.seed is not None else secrets.randbelow(SEED_LIMIT)
    image = fields.image_params(seed)
    image_job(image, DiffusionArgs.model_validate(painter.engine_args).max_generated_image_size)
    return seed, image


async def answer(
    request: Request,
    omni: PipelineService,
    pipeline_request: PipelineRequest,
    kind: str,
    fields: ImageFields,
) -> Response:
    """Run ``pipeline_request`` and answer in OpenAI's shape: the images as one JSON
    body, or with ``stream`` as ``{kind}.progress`` / ``{kind}.completed`` events."""
    stream = await omni.open(pipeline_request)
    if fields.stream:
        outputs = await peeked(stream)
        shape = ChunkShape(stream.request_id, "image", int(time.time()), omni.served_model, False)
        render = ImageEvents(kind, fields.output_format, stream).render
        return sse_response(sse_events(outputs, stream, shape, render), stream)
    got = await collect_into(request, stream, ImageSink())
    if got is None:
        return Response(status_code=499)  # the client went away; the request is aborted
    return json_response(got.response(fields.size, fields.output_format, stream.usage()))


def image_stage(omni: PipelineService, wanted: str | None, path: str) -> StageConfig:
    """The image stage a request names (or the only one); 404 naming ``path`` if none."""
    missing = (
        f"image stage (engine diffusion); {path} needs one (e.g. the built-in painter pipeline)"
    )
    stages = engine_stages(omni, EngineName.DIFFUSION, missing, "no_image_stage")
    return pick_stage(omni, stages, wanted, "image stage", "no_image_stage")  # type: ignore[no-any-return]


def _writers(omni: PipelineService, painter: StageConfig) -> list[int]:
    """The text stages feeding the image stage: what they write is the revised prompt."""
    return [
        sid for sid in painter.inputs if omni.graph.stages[sid].output_modality == Modality.TEXT
    ]


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI's image usage: input is the prompt's tokens, output the revised prompt's."""
    read, wrote = usage.prompt_tokens, usage.completion_tokens
    return {
        "input_tokens": read,
        "input_tokens_details": {"text_tokens": read, "image_tokens": 0},
        "output_tokens": wrote,
        "output_tokens_details": {"text_tokens": wrote, "image_tokens": 0},
        "total_tokens": read + wrote,
    }


@dataclass
class ImageSink:
    """A whole request's outputs: the revised prompt and the images, in order."""

    revised: list[str] = field(default_factory=list)
    images: dict[int, tuple[bytes, ImageMeta]] = field(default_factory=dict)
    wrote: bool = False  # some stage before the image stage ran

    def add(self, out: OutputChunk) -> None:
        if out.modality == Modality.TEXT:
            self.wrote = True
            self.revised.append(out.text)
        elif out.data and isinstance(out.meta, ImageMeta):
            index = out.meta.index if out.meta.index is not None else len(self.images)
            self.images[index] = (out.data, out.meta)

    def revised_prompt(self) -> str | None:
        return "".join(self.revised).strip() if self.wrote else None

    def response(self, size: str | None, output_format: str, usage: Usage) -> dict[str, Any]:
        """OpenAI's answer: ``size`` as asked until an image says what it is."""
        revised = self.revised_prompt()
        data = []
        size = size or "auto"
        for index in sorted(self.images):
            image, meta = self.images[index]
            item: dict[str, Any] = {"b64_json": base64.b64encode(image).decode()}
            if revised is not None:
                item["revised_prompt"] = revised
            item["seed"] = meta.seed
            data.append(item)
            size = f"{meta.width}x{meta.height}"
        return {
            "created": int(time.time()),
            "data": data,
            "output_format": output_format,
            "size": size,
            "usage": usage_body(usage),
        }


class ImageEvents:
    """The SSE events of a streamed answer, one output at a time: ``{kind}.progress``
    and ``{kind}.completed`` (kind ``image_generation`` or ``image_edit``)."""

    def __init__(self, kind: str, output_format: str, stream: OutputStream) -> None:
        self._kind = kind
        self._output_format = output_format
        self._stream = stream
        self._got = ImageSink()

    def render(self, out: OutputChunk) -> list[bytes]:
        self._got.add(out)
        meta = out.meta
        if isinstance(meta, ProgressMeta):
            return [sse({"type": f"{self._kind}.progress", **_progress(meta)})]
        if out.modality == Modality.TEXT or not out.data or not isinstance(meta, ImageMeta):
            return []
        event: dict[str, Any] = {
            "type": f"{self._kind}.completed",
            "b64_json": base64.b64encode(out.data).decode(),
            "created_at": int(time.time()),
            "size": f"{meta.width}x{meta.height}",
            "quality": "auto",
            "background": "opaque",
            "output_format": self._output_format,
            "usage": usage_body(self._stream.usage()),
            "image_index": meta.index or 0,
            "seed": meta.seed,
        }
        revised = self._got.revised_prompt()
        if revised is not None:
            event["revised_prompt"] = revised
        return [sse(event)]


def _progress(meta: ProgressMeta) -> dict[str, Any]:
    return {"image_index": meta.index or 0, "step": meta.step, "steps": meta.steps}

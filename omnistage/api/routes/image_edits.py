"""POST /v1/images/edits: an image (and maybe a mask) and a prompt in, edited images out,
in OpenAI's shape (the same as generations').

A multipart form, as the openai SDK's ``client.images.edit`` sends it: the file
``image`` (or ``image[]`` for a list; one image per request here, as the pipelines start
from one), an optional file ``mask`` (the image's size; its fully transparent pixels mark
where to edit), and the fields of ``ImageEditForm``. Served by the pipeline's image stage
alone, with the prompt as given (no thinker revises it): image-to-image without a mask,
inpainting with one (see engines/image/edits.py). The uploads are decoded here, in a
worker thread, so a file that is no image or a mask that does not fit is a 400 before any
replica sees it. ``stream: true`` sends ``image_edit.progress`` (omnistage's) and
``image_edit.completed`` events, as generations do.

A normal FastAPI route, not a fast path: the multipart parsing and the drawing dwarf
FastAPI's own cost.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.responses import Response

from omnistage.api.errors import invalid_body
from omnistage.api.ids import next_id
from omnistage.api.routes.common import (
    check_model,
    engine_stages,
    pick_stage,
    service,
)
from omnistage.api.routes.images import answer, seeded_params
from omnistage.api.schemas.images import EDIT_FORM_DOC, ImageEditForm
from omnistage.engines.image.edits import check_edit
from omnistage.protocol.codec import MAX_MESSAGE_BYTES
from omnistage.protocol.enums import EngineName
from omnistage.protocol.errors import ApiError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ChatMessage, Prompt
from omnistage.protocol.params import StageParams

router = APIRouter()

PATH = "/v1/images/edits"
# OpenAI's limits: an image under 50 MB, a mask under 4 MB. Both travel to the replica in
# one message, with room for the rest of it.
MAX_IMAGE_BYTES = 50 * 1024 * 1024
MAX_MASK_BYTES = 4 * 1024 * 1024
assert MAX_IMAGE_BYTES + MAX_MASK_BYTES < MAX_MESSAGE_BYTES - 1024 * 1024
# The body limit on this route (see api/app.py): the files and the rest of the form.
EDIT_BODY_BYTES = MAX_IMAGE_BYTES + MAX_MASK_BYTES + 1024 * 1024
# OpenAI takes up to 16 images: more parts than that are refused by the form parser;
# up to it, the route says how many it takes (one).
_MAX_FILES = 16 + 1


@router.post(PATH, openapi_extra=EDIT_FORM_DOC)
async def edits(request: Request) -> Response:
    omni = service(request)
    missing = f"image stage (engine diffusion); {PATH} needs one (e.g. the painter pipeline)"
    stages = engine_stages(omni, EngineName.DIFFUSION, missing, "no_image_stage")
    form = await request.form(max_files=_MAX_FILES, max_fields=64)
    try:
        fields, images, mask = await _read_form(form)
    finally:
        await form.close()
    check_model(omni, fields.model)
    painter = pick_stage(omni, stages, fields.stage, "image stage", "no_image_stage")
    _, image = seeded_params(fields, painter)
    # Decoding a large image takes a while: not on the event loop.
    await asyncio.to_thread(check_edit, images, mask)
    prompt = Prompt(messages=[ChatMessage("user", fields.prompt)], images=images, mask=mask)
    sid = painter.stage_id
    pipeline_request = PipelineRequest(
        f"img-{next_id()}", prompt, [sid], stage_params={sid: StageParams(image=image)}, only=True
    )
    return await answer(request, omni, pipeline_request, "image_edit", fields)


async def _read_form(form: FormData) -> tuple[ImageEditForm, list[bytes], bytes | None]:
    """The checked fields, the images' bytes and the mask's."""
    for key in form:
        if key.startswith("stage_params"):
            raise _bad(
                "stage_params: not taken by image edits (only the image stage runs: give "
                "its fields directly)",
                "stage_params",
            )
    values = {k: v for k, v in form.multi_items() if k in ImageEditForm.model_fields}
    try:
        fields = ImageEditForm.model_validate(values)
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None
    uploads = form.getlist("image") + form.getlist("image[]")
    if not uploads:
        raise _bad("image: an image file to edit is required", "image")
    images = [await _file(u, "image", MAX_IMAGE_BYTES) for u in uploads]
    upload = form.get("mask")
    mask = None if upload is None else await _file(upload, "mask", MAX_MASK_BYTES)
    return fields, images, mask


async def _file(upload: UploadFile | str, param: str, limit: int) -> bytes:
    if not isinstance(upload, UploadFile):
        raise _bad(f"{param}: must be uploaded as a file (a form part with a filename)", param)
    if upload.size is not None and upload.size > limit:
        raise _too_large(param, upload.size, limit)
    data = await upload.read()
    if len(data) > limit:
        raise _too_large(param, len(data), limit)
    if not data:
        raise _bad(f"{param}: the uploaded file is empty", param)
    return data


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def _too_large(param: str, size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"{param}: {size} bytes is over the {limit} bytes an image edit takes",
        "invalid_request_error",
        param,
        "request_too_large",
    )

"""The ``diffusion`` engine: text in, images out, on a local HF diffusers pipeline.

A source stage draws its prompt's text; a downstream stage (a painter after a thinker)
waits for all of its upstream text and draws that. A request asks for ``n`` images;
image i is drawn with seed ``seed + i`` from a CPU ``torch.Generator``, so the same
request gives the same bytes on any replica (the images route fixes the seed before the
request runs; without one the engine draws a random one and reports it). Each image is one
output chunk: the encoded file in ``data``, an ``ImageMeta`` (format, size, seed, index)
in ``meta``; the last one is finished and carries the usage.

A prompt with ``images`` is an edit (POST /v1/images/edits): image-to-image from its
(single) image, or inpainting where its ``mask`` is transparent, each on a variant of the
loaded pipeline over the same weights, built on first use per slot and kept (see
``diffusers_pipe.variant``). Size "auto" is then the source image's size, fitted within
``max_generated_image_size``; the source is resized to the size drawn.

Slots, progress and abort are the shared ``denoising`` engine's: with the param
``progress`` every denoising step also streams a chunk with no data and a
``ProgressMeta`` (step, steps, index; an edit's ``steps`` are those it runs).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from omnistage.config.engine_args import DiffusionArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest
from omnistage.engines.image import diffusers_pipe as dp
from omnistage.engines.image.denoising import DenoisingEngine, Slot, missing_model_message
from omnistage.protocol.chunk_meta import ImageMeta, ProgressMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.image_params import ImageJob, image_job, output_size
from omnistage.protocol.messages import Usage
from omnistage.protocol.params import SEED_LIMIT, StageParams

__all__ = ["DiffusionEngine", "missing_model_message"]

log = logging.getLogger(__name__)

WARMUP_STEPS = 1


class DiffusionEngine(DenoisingEngine[dp.PipelineInfo, dp.Drawing, bytes]):
    args: DiffusionArgs

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage, DiffusionArgs.model_validate(stage.engine_args))

    def _load(self, model: str) -> tuple[Any, dp.PipelineInfo]:
        return dp.load(self.args, model)

    def _described(self) -> str:
        (width, height), steps = self._info().default_size, self._info().default_steps
        return f"default size {width}x{height}, {steps} steps"

    def _warmup_job(self) -> dp.Drawing:
        return dp.Drawing("warm-up", 64, 64, 0, WARMUP_STEPS, None, None, "png", 90)

    def _work(
        self,
        slot: Slot,
        job: dp.Drawing,
        call: dict[str, Any],
        stop: threading.Event,
        on_step: dp.StepHook,
    ) -> bytes:
        pipe, info = self._pipe_for(slot, job.kind)
        return dp.draw(pipe, info, job, call, stop, on_step)

    def _pipe_for(self, slot: Slot, kind: str | None) -> tuple[Any, dp.PipelineInfo]:
        """The slot's pipeline for a drawing of ``kind`` (on the slot's thread)."""
        if kind is None:
            return slot.pipe, self._info()
        if kind not in slot.variants:
            slot.variants[kind] = dp.variant(slot.pipe, kind, self.args)
        return slot.variants[kind]

    def check(self, params: StageParams) -> None:
        image_job(params.imaging, self.args.max_generated_image_size)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        info = self._info()
        job = image_job(request.params.imaging, self.args.max_generated_image_size)
        prompt = await self._prompt(request)
        base_seed = job.seed if job.seed is not None else secrets.randbelow(SEED_LIMIT)
        edit = _edit_of(request)
        source = None
        if edit is not None:  # headers only here; the worker thread decodes
            from omnistage.engines.image.edits import check_edit

            source = check_edit(*edit, full=False)
        max_pixels = self.args.max_generated_image_size
        width, height = output_size(job.size, source, info.default_size, max_pixels)
        modality = self.stage.output_modality
        usage = Usage(dp.count_tokens(self._pipe, prompt))
        for index in range(job.n):
            seed = (base_seed + index) % SEED_LIMIT
            drawing = self._drawing(job, prompt, (width, height), seed, edit)
            async for chunk in self._draw_one(request.request_id, drawing, job, index):
                if chunk.data and index == job.n - 1:
                    chunk.finished, chunk.usage = True, usage
                    chunk.finish_reason = FinishReason.STOP
                chunk.modality = modality
                yield chunk

    def _drawing(
        self,
        job: ImageJob,
        prompt: str,
        size: tuple[int, int],
        seed: int,
        edit: tuple[list[bytes], bytes | None] | None,
    ) -> dp.Drawing:
        return dp.Drawing(
            prompt=prompt,
            width=size[0],
            height=size[1],
            seed=seed,
            output_format=job.output_format,
            quality=job.quality,
            image=edit[0][0] if edit is not None else None,
            mask=edit[1] if edit is not None else None,
            strength=job.strength if edit is not None else None,
            **self._call_fields(job),
        )

    async def _draw_one(
        self, request_id: str, drawing: dp.Drawing, job: ImageJob, index: int
    ) -> AsyncIterator[EngineChunk]:
        """Progress chunks (if asked for), then the image's chunk."""
        started = time.perf_counter()
        name = f"{request_id} image {index + 1}/{job.n}"
        generation = await self._generation(drawing, job.progress, lambda: name)
        async for step, steps in generation:
            meta = ProgressMeta(step, steps, index)
            yield EngineChunk(Modality.IMAGE, meta=meta)
        data = generation.result()
        self.progress += 1
        log.info(
            "%s: %dx%d, %d steps in %.2fs (seed %d)",
            name,
            drawing.width,
            drawing.height,
            drawing.steps,
            time.perf_counter() - started,
            drawing.seed,
        )
        meta = ImageMeta(
            format=drawing.output_format,
            width=drawing.width,
            height=drawing.height,
            seed=drawing.seed,
            index=index,
        )
        yield EngineChunk(Modality.IMAGE, data=data, meta=meta)


def _edit_of(request: EngineRequest) -> tuple[list[bytes], bytes | None] | None:
    """The source images and mask of an edit request (None: draw from text alone)."""
    prompt = request.prompt
    if prompt is None or not prompt.images:
        return None
    return prompt.images, prompt.mask

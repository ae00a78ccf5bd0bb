"""The ``video`` engine: text (and optionally a first frame) in, an MP4 out, on a local HF
diffusers video pipeline (Wan, CogVideoX, LTX, ...).

A request asks for a length (``num_frames``, or ``seconds`` at ``fps``), a size and a
seed; a pipeline that makes only some lengths (Wan: 4k+1 frames) makes the nearest one,
and the chunks report the count made. The seed drives a CPU ``torch.Generator``, so the
same request gives the same bytes on any replica (without one the engine draws a random
one and reports it). Output, in order:

- with the param ``progress``, a chunk per denoising step: no data, a ``ProgressMeta``;
- the first frame as a thumbnail, an IMAGE chunk: PNG bytes, an ``ImageMeta`` (format
  "png", width, height);
- the video, the finished VIDEO chunk with the usage: MP4 bytes (H.264, 4:2:0), a
  ``VideoMeta`` (width, height, frames, fps, seed).

A pipeline whose ``__call__`` takes ``image`` animates the prompt's first image
(``Prompt.images[0]``, resized to the video's size); any other refuses images with a 400
naming ``input_reference``. Slots, progress and abort are the shared ``denoising``
engine's.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from omnistage.config.engine_args import VideoArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest
from omnistage.engines.image.denoising import DenoisingEngine, Slot
from omnistage.engines.image.diffusers_pipe import StepHook, count_tokens
from omnistage.engines.video import pipe as vp
from omnistage.protocol.chunk_meta import ImageMeta, ProgressMeta, VideoMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import Usage
from omnistage.protocol.params import SEED_LIMIT, StageParams, VideoParams
from omnistage.protocol.video_params import EVEN, VideoJob, video_job

log = logging.getLogger(__name__)

WARMUP_STEPS = 1
INPUT_REFERENCE = "input_reference"  # the param a client's first frame arrives as


class VideoEngine(DenoisingEngine[vp.VideoInfo, vp.Clip, vp.Video]):
    args: VideoArgs

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage, VideoArgs.model_validate(stage.engine_args))

    def _load(self, model: str) -> tuple[Any, vp.VideoInfo]:
        return vp.load(self.args, model)

    def _described(self) -> str:
        info, args = self._info(), self.args
        (width, height), steps = info.default_size, info.default_steps
        frames = vp.frames_for(info, round(args.default_seconds * args.default_fps), 10**9)
        image = " (image-to-video)" if info.takes_image else ""
        return (
            f"default {width}x{height}, {frames} frames at {args.default_fps} fps, {steps} "
            f"steps; sides multiples of {info.size_step}, frames 1 + k*{info.frame_step}{image}"
        )

    def _warmup_job(self) -> vp.Clip:
        info = self._info()
        side = max(info.size_step, 16)
        frames = 1 + info.frame_step  # two latent frames: the time axis works too
        image = vp.blank_image(side, side) if info.needs_image else None
        return vp.Clip("warm-up", side, side, 0, WARMUP_STEPS, None, None, frames, 8, image)

    def _work(
        self,
        slot: Slot,
        job: vp.Clip,
        call: dict[str, Any],
        stop: threading.Event,
        on_step: StepHook,
    ) -> vp.Video:
        return vp.film(slot.pipe, self._info(), job, call, stop, on_step)

    def _work_size(self, job: vp.Clip) -> int:
        return job.width * job.height * job.frames

    def _job(self, params: VideoParams) -> VideoJob:
        step = self.info.size_step if self.info is not None else EVEN
        return video_job(params, self.args, step)

    def check(self, params: StageParams) -> None:
        self._job(params.filming)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        info = self._info()
        job = self._job(request.params.filming)
        width, height = job.size or info.default_size
        image = await self._first_frame(request, width, height)
        prompt = await self._prompt(request)
        seed = job.seed if job.seed is not None else secrets.randbelow(SEED_LIMIT)
        clip = self._clip(job, prompt, width, height, seed, image)
        started = time.perf_counter()
        name = f"{request.request_id} video"
        generation = await self._generation(clip, job.progress, lambda: name)
        async for step, steps in generation:
            yield EngineChunk(Modality.VIDEO, meta=ProgressMeta(step, steps))
        video = generation.result()
        self.progress += 1
        log.info(
            "%s: %dx%d, %d frames at %d fps, %d steps in %.2fs (seed %d)",
            name,
            video.width,
            video.height,
            video.frames,
            clip.fps,
            clip.steps,
            time.perf_counter() - started,
            seed,
        )
        thumb = ImageMeta(format="png", width=video.width, height=video.height)
        yield EngineChunk(Modality.IMAGE, data=video.thumbnail, meta=thumb)
        yield EngineChunk(
            Modality.VIDEO,
            data=video.mp4,
            finished=True,
            finish_reason=FinishReason.STOP,
            usage=Usage(count_tokens(self._pipe, prompt)),
            meta=VideoMeta(
                width=video.width,
                height=video.height,
                frames=video.frames,
                fps=clip.fps,
                seed=seed,
            ),
        )

    async def _first_frame(self, request: EngineRequest, width: int, height: int) -> Any:
        """The client's image to animate, decoded and resized (None: text-to-video)."""
        info = self._info()
        images = request.prompt.images if request.prompt is not None else None
        if not images:
            if info.needs_image:
                raise BadRequestError(
                    f"this model ({info.class_name}) animates an image: give {INPUT_REFERENCE}",
                    INPUT_REFERENCE,
                )
            return None
        if not info.takes_image:
            raise BadRequestError(
                f"this model ({info.class_name}) makes video from text only: it takes no "
                f"{INPUT_REFERENCE}",
                INPUT_REFERENCE,
            )
        return await asyncio.to_thread(vp.decode_image, images[0], width, height)

    def _clip(
        self, job: VideoJob, prompt: str, width: int, height: int, seed: int, image: Any
    ) -> vp.Clip:
        return vp.Clip(
            prompt=prompt,
            width=width,
            height=height,
            seed=seed,
            frames=vp.frames_for(self._info(), job.frames, self.args.max_frames),
            fps=job.fps,
            image=image,
            **self._call_fields(job),
        )

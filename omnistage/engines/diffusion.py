"""The ``diffusion`` engine: text in, images out, on a local HF diffusers pipeline.

A source stage draws its prompt's text; a downstream stage (a painter after a thinker)
waits for all of its upstream text and draws that. A request asks for ``n`` images;
image i is drawn with seed ``seed + i`` from a CPU ``torch.Generator``, so the same
request gives the same bytes on any replica (the images route fixes the seed before the
request runs; without one the engine draws a random one and reports it). Each image is one
output chunk: the encoded file in ``data``, ``meta = {"format", "width", "height",
"seed", "index"}``; the last one is finished and carries the usage.

A prompt with ``images`` is an edit (POST /v1/images/edits): image-to-image from its
(single) image, or inpainting where its ``mask`` is transparent, each on a variant of the
loaded pipeline over the same weights, built on first use per slot and kept (see
``diffusers_pipe.variant``). Size "auto" is then the source image's size, fitted within
``max_generated_image_size``; the source is resized to the size drawn.

Diffusion is compute bound: at most ``max_concurrent`` images (default 1) are drawn at
once, each in a worker thread on its own handle of the shared weights; other requests
wait for a slot (``queue_length``). Every denoising step bumps ``progress`` (heartbeats
carry it, so a long generation is not mistaken for a stall), is logged every
``log_every_steps`` steps, and with the param ``progress`` streams a chunk with no data
and ``meta = {"step", "steps", "index"}``. Abort is cancellation: the step callback then
raises, so the thread stops before the next step (and before the VAE decode) and only
then frees its slot.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from omnistage.config.engine_args import DiffusionArgs
from omnistage.config.schema import StageConfig
from omnistage.engines import diffusers_pipe as dp
from omnistage.engines.base import Engine, EngineChunk, EngineRequest, prompt_text
from omnistage.engines.image_params import ImageJob, image_job, output_size
from omnistage.engines.torch_threads import (
    ThreadTuner,
    TorchThread,
    cores,
    thread_ladder,
    use_threads,
)
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import EngineError
from omnistage.protocol.messages import ChunkMeta
from omnistage.protocol.params import SEED_LIMIT, StageParams

log = logging.getLogger(__name__)

WARMUP_STEPS = 1


def missing_model_message(stage: StageConfig, pipeline: str | None = None) -> str:
    """What to tell an operator who left out the model (the CLI, or a replica's start)."""
    override = (
        f'\'{{"{stage.stage_id}": {{"engine_args": {{"model": "/path/to/diffusers-dir"}}}}}}\''
    )
    how = (
        f"omnistage serve {pipeline} --stage-overrides {override}"
        if pipeline
        else (f"--stage-overrides {override}")
    )
    return (
        f"stage {stage.stage_id} {stage.name!r} (engine diffusion) needs engine_args.model, a "
        "local diffusers pipeline directory (no package ships text-to-image weights and "
        f"nothing is downloaded); give it with: {how}"
    )


@dataclass(eq=False)
class _Slot:
    """One generation at a time: a pipeline handle, the thread that runs it (the first
    slot's also loaded the weights: one OpenMP pool per thread, see torch_threads), and
    how many torch threads it uses (None: fixed by ``torch_threads``)."""

    pipe: Any
    thread: TorchThread
    tuner: ThreadTuner | None
    # Edit variants of ``pipe`` (by Drawing.kind), built on the slot's thread when first
    # needed; they share its modules and scheduler, as the slot draws one at a time.
    variants: dict[str, tuple[Any, dp.PipelineInfo]] = field(default_factory=dict)


class DiffusionEngine(Engine):
    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args = DiffusionArgs.model_validate(stage.engine_args)
        self.info: dp.PipelineInfo | None = None
        self._pipe: Any = None
        # A generation takes a slot and gives it back.
        self._free: list[_Slot] = []
        self._slots = asyncio.Semaphore(self.args.max_concurrent)
        self._waiting = 0
        self.load_time_s: float | None = None

    @property
    def queue_length(self) -> int:
        return self._waiting

    async def start(self) -> None:
        model = self.args.model
        if not model:
            raise EngineError(missing_model_message(self.stage))
        started = time.perf_counter()
        self.starting = f"loading the diffusers pipeline {model}"
        slots = self.args.max_concurrent
        threads = [TorchThread(f"omni-diffusion-{i}") for i in range(slots)]
        pipe, self.info = await asyncio.wrap_future(
            threads[0].run(lambda: dp.load(self.args, model))
        )
        self._pipe = pipe
        pipes = [pipe] + [dp.replica_of(pipe) for _ in range(slots - 1)]
        # No torch_threads: each slot picks 1..its share of the cores by timing its
        # denoising steps (which needs the step callback).
        share = max(1, cores() // slots)
        tuned = self.args.torch_threads is None and self.info.takes_step_callback
        self._free = [
            _Slot(p, t, ThreadTuner(thread_ladder(share)) if tuned else None)
            for p, t in zip(pipes, threads, strict=True)
        ]
        self.load_time_s = time.perf_counter() - started
        info = self.info
        log.info(
            "diffusion pipeline %s loaded from %s in %.2fs: default size %dx%d, %d steps%s",
            info.class_name,
            model,
            self.load_time_s,
            *info.default_size,
            info.default_steps,
            ""
            if info.takes_step_callback
            else " (no step callback: no per-step progress or abort)",
        )
        if self.args.warmup:
            await self._warm_up()

    async def _warm_up(self) -> None:
        # The first call pays one-off costs (kernels, allocator) worth seconds; pay them
        # before READY, on the smallest image, not on a client's first request.
        started = time.perf_counter()
        job = dp.Drawing("warm-up", 64, 64, 0, WARMUP_STEPS, None, None, "png", 90)
        slot = self._free[0]
        try:
            await asyncio.wrap_future(
                slot.thread.run(lambda: self._draw_on(slot, job, {}, threading.Event(), _no_hook))
            )
        except Exception as exc:  # a pipeline that cannot draw 64x64 may still draw others
            log.warning("warm-up generation failed (%s); continuing without", exc)
            return
        log.info("warm-up generation took %.2fs", time.perf_counter() - started)

    def check(self, params: StageParams) -> None:
        image_job(params.imaging, self.args.max_generated_image_size)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        info = self._info()
        job = image_job(request.params.imaging, self.args.max_generated_image_size)
        if request.prompt is not None:
            prompt = prompt_text(request.prompt)
        else:  # a painter draws what its upstream stage wrote, all of it
            prompt = "".join([i.text async for i in request.inputs if i.modality == Modality.TEXT])
        prompt = prompt.strip()
        base_seed = job.seed if job.seed is not None else secrets.randbelow(SEED_LIMIT)
        edit = _edit_of(request)
        source = None
        if edit is not None:  # headers only here; the worker thread decodes
            from omnistage.engines.edit_images import check_edit

            source = check_edit(*edit, full=False)
        max_pixels = self.args.max_generated_image_size
        width, height = output_size(job.size, source, info.default_size, max_pixels)
        modality = self.stage.output_modality
        usage = {"prompt_tokens": dp.count_tokens(self._pipe, prompt), "completion_tokens": 0}
        for index in range(job.n):
            drawing = self._drawing(job, prompt, width, height, (base_seed + index) % SEED_LIMIT)
            if edit is not None:
                image, mask = edit[0][0], edit[1]
                drawing = replace(drawing, image=image, mask=mask, strength=job.strength)
            async for chunk in self._draw_one(request.request_id, drawing, job, index):
                if chunk.data and index == job.n - 1:
                    chunk.finished, chunk.usage = True, usage
                    chunk.finish_reason = FinishReason.STOP
                chunk.modality = modality
                yield chunk

    def _drawing(
        self, job: ImageJob, prompt: str, width: int, height: int, seed: int
    ) -> dp.Drawing:
        """Request params first, then diffusers_call_kwargs, then engine_args defaults,
        then the pipeline's own defaults."""
        call = self.args.diffusers_call_kwargs
        steps = job.num_inference_steps or call.get("num_inference_steps")
        guidance = job.guidance_scale
        if guidance is None:
            guidance = call.get("guidance_scale", self.args.guidance_scale)
        return dp.Drawing(
            prompt=prompt,
            width=width,
            height=height,
            seed=seed,
            steps=int(steps or self.args.num_inference_steps or self._info().default_steps),
            guidance_scale=guidance,
            negative_prompt=job.negative_prompt or call.get("negative_prompt"),
            output_format=job.output_format,
            quality=job.quality,
        )

    async def _draw_one(
        self, request_id: str, drawing: dp.Drawing, job: ImageJob, index: int
    ) -> AsyncIterator[EngineChunk]:
        """Progress chunks (if asked for), then the image's chunk."""
        loop = asyncio.get_running_loop()
        steps_done: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        stop = threading.Event()
        started = time.perf_counter()
        every = self.args.log_every_steps

        def on_step(step: int, total: int) -> None:  # in the worker thread
            self.progress += 1
            if step % every == 0 and step < total:
                log.info(
                    "%s image %d/%d: step %d/%d, %.2f it/s",
                    request_id,
                    index + 1,
                    job.n,
                    step,
                    total,
                    dp.it_per_s(step, started),
                )
            if job.progress:
                loop.call_soon_threadsafe(steps_done.put_nowait, (step, total))

        work = await self._start(drawing, stop, on_step)
        work.add_done_callback(lambda _: steps_done.put_nowait((0, 0)))  # steps count from 1
        try:
            while (done := await steps_done.get())[0] != 0:
                meta = ChunkMeta(step=done[0], steps=done[1], index=index)
                yield EngineChunk(Modality.IMAGE, meta=meta)
            data = work.result()
        except asyncio.CancelledError:
            stop.set()
            raise
        self.progress += 1
        log.info(
            "%s image %d/%d: %dx%d, %d steps in %.2fs (seed %d)",
            request_id,
            index + 1,
            job.n,
            drawing.width,
            drawing.height,
            drawing.steps,
            time.perf_counter() - started,
            drawing.seed,
        )
        meta = ChunkMeta(
            format=drawing.output_format,
            width=drawing.width,
            height=drawing.height,
            seed=drawing.seed,
            index=index,
        )
        yield EngineChunk(Modality.IMAGE, data=data, meta=meta)

    async def _start(
        self, drawing: dp.Drawing, stop: threading.Event, on_step: dp.StepHook
    ) -> asyncio.Future[bytes]:
        """Start drawing in a worker thread once a slot is free. The slot (and its
        pipeline handle) comes back when the thread ends, not when the request does:
        an aborted generation still holds it until its next step."""
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        slot = self._free.pop()
        call = self.args.diffusers_call_kwargs
        try:
            work = asyncio.wrap_future(
                slot.thread.run(lambda: self._draw_on(slot, drawing, call, stop, on_step))
            )
        except BaseException:
            self._release(slot)
            raise

        def done(fut: asyncio.Future[bytes]) -> None:
            self._release(slot)
            if not fut.cancelled() and isinstance(fut.exception(), dp.Aborted):
                log.info("generation stopped (aborted)")

        work.add_done_callback(done)
        return work

    def _draw_on(
        self,
        slot: _Slot,
        drawing: dp.Drawing,
        call: dict[str, Any],
        stop: threading.Event,
        on_step: dp.StepHook,
    ) -> bytes:
        """One image on the slot's thread, its thread count tuned between steps."""
        pipe, info = self._pipe_for(slot, drawing.kind)
        tuner = slot.tuner
        if tuner is None:
            return dp.draw(pipe, info, drawing, call, stop, on_step)
        use_threads(tuner.count)
        pixels = drawing.width * drawing.height
        last: list[float] = []

        def timed(step: int, total: int) -> None:
            if last:  # from the end of the previous step's hook: one denoising step
                use_threads(tuner.observe(pixels, time.perf_counter() - last[0]))
            on_step(step, total)
            last[:] = [time.perf_counter()]

        return dp.draw(pipe, info, drawing, call, stop, timed)

    def _pipe_for(self, slot: _Slot, kind: str | None) -> tuple[Any, dp.PipelineInfo]:
        """The slot's pipeline for a drawing of ``kind`` (on the slot's thread)."""
        if kind is None:
            return slot.pipe, self._info()
        if kind not in slot.variants:
            slot.variants[kind] = dp.variant(slot.pipe, kind, self.args)
        return slot.variants[kind]

    def _release(self, slot: _Slot) -> None:
        self._free.append(slot)
        self._slots.release()

    def _info(self) -> dp.PipelineInfo:
        if self.info is None:
            raise EngineError("the diffusion engine has not been started")
        return self.info

    async def shutdown(self) -> None:
        self._free.clear()
        self._pipe = None


def _no_hook(_step: int, _total: int) -> None:
    pass


def _edit_of(request: EngineRequest) -> tuple[list[bytes], bytes | None] | None:
    """The source images and mask of an edit request (None: draw from text alone)."""
    prompt = request.prompt
    if prompt is None or not prompt.images:
        return None
    return prompt.images, prompt.mask

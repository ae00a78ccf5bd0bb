"""What the engines on a diffusers pipeline share (``diffusion``, ``video``): loading the
pipeline into generation slots, and running one generation on a slot with its denoising
steps streamed back to the event loop.

Diffusion is compute bound: at most ``max_concurrent`` generations (default 1) run at
once, each in a worker thread on its own handle of the shared weights; other requests
wait for a slot (``queue_length``). Every denoising step bumps ``progress`` (heartbeats
carry it, so a long generation is not mistaken for a stall) and is logged every
``log_every_steps`` steps. Abort is cancellation: the step callback then raises, so the
thread stops before the next step (and before the VAE decode) and only then frees its
slot.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from omnistage.config.engine_args import DiffusersArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine, EngineRequest, prompt_text
from omnistage.engines.image import diffusers_pipe as dp
from omnistage.engines.torch_threads import (
    ThreadTuner,
    TorchThread,
    cores,
    thread_ladder,
    use_threads,
)
from omnistage.protocol.enums import Modality
from omnistage.protocol.errors import EngineError

log = logging.getLogger(__name__)

# What each engine draws, for the message an operator gets without a model.
_OUTPUTS = {"diffusion": "text-to-image", "video": "video"}

InfoT = TypeVar("InfoT", bound=dp.PipelineInfo)
JobT = TypeVar("JobT", bound=dp.Call)
ResultT = TypeVar("ResultT")


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
    what = _OUTPUTS.get(stage.engine, "its")
    return (
        f"stage {stage.stage_id} {stage.name!r} (engine {stage.engine}) needs "
        "engine_args.model, a local diffusers pipeline directory (no package ships "
        f"{what} weights and nothing is downloaded); give it with: {how}"
    )


class Asked(Protocol):
    """What every kind of request may set of a pipeline call (ImageJob, VideoJob)."""

    @property
    def num_inference_steps(self) -> int | None: ...
    @property
    def guidance_scale(self) -> float | None: ...
    @property
    def negative_prompt(self) -> str | None: ...


@dataclass(eq=False)
class Slot:
    """One generation at a time: a pipeline handle, the thread that runs it (the first
    slot's also loaded the weights: one OpenMP pool per thread, see torch_threads), and
    how many torch threads it uses (None: fixed by ``torch_threads``)."""

    pipe: Any
    thread: TorchThread
    tuner: ThreadTuner | None
    # Other pipelines over ``pipe``'s modules (the diffusion engine's edit variants, by
    # kind, with their info), built on the slot's thread when first needed. They share
    # its scheduler too: the slot runs one call at a time.
    variants: dict[str, Any] = field(default_factory=dict)


Step = tuple[int, int]  # (steps done, total steps), as the pipeline counts them


class Generation(Generic[ResultT]):
    """A generation under way in a slot's thread: iterate it for each denoising step as
    it ends (only those the thread reported), then read ``result()``. Leaving the loop
    early (the request was aborted) stops the thread at its next step."""

    def __init__(
        self, work: asyncio.Future[ResultT], steps: asyncio.Queue[Step], stop: threading.Event
    ) -> None:
        self.work = work
        self._steps = steps
        self._stop = stop

    async def __aiter__(self) -> AsyncIterator[Step]:
        # Steps count from 1: (0, 0) ends the loop.
        self.work.add_done_callback(lambda _: self._steps.put_nowait((0, 0)))
        try:
            while (step := await self._steps.get())[0] != 0:
                yield step
        finally:
            if not self.work.done():
                self._stop.set()

    def result(self) -> ResultT:
        return self.work.result()


class DenoisingEngine(Engine, Generic[InfoT, JobT, ResultT]):
    """The shared half of an engine on a diffusers pipeline. A subclass loads and
    describes its pipeline (``_load``), runs one job on a pipeline handle in the worker
    thread (``_work``), and turns requests into jobs."""

    args: DiffusersArgs

    def __init__(self, stage: StageConfig, args: DiffusersArgs) -> None:
        super().__init__(stage)
        self.args = args
        self.info: InfoT | None = None
        self._pipe: Any = None
        # A generation takes a slot and gives it back.
        self._free: list[Slot] = []
        self._slots = asyncio.Semaphore(args.max_concurrent)
        self._waiting = 0
        self.load_time_s: float | None = None

    # -- what a subclass provides -------------------------------------------------------

    @abc.abstractmethod
    def _load(self, model: str) -> tuple[Any, InfoT]:
        """The pipeline and what the engine needs to know of it (in the worker thread)."""

    @abc.abstractmethod
    def _work(
        self,
        slot: Slot,
        job: JobT,
        call: dict[str, Any],
        stop: threading.Event,
        on_step: dp.StepHook,
    ) -> ResultT:
        """One generation on the slot's pipeline (in the slot's worker thread)."""

    @abc.abstractmethod
    def _warmup_job(self) -> JobT:
        """The smallest generation, to pay the first call's one-off costs before READY."""

    @abc.abstractmethod
    def _described(self) -> str:
        """What the log line at load says of the pipeline's defaults."""

    def _work_size(self, job: JobT) -> int:
        """How much work one denoising step of ``job`` is, for the thread tuner (steps of
        the same size are timed against each other)."""
        return job.width * job.height

    # -- loading ------------------------------------------------------------------------

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
        threads = [TorchThread(f"omni-{self.name}-{i}") for i in range(slots)]
        pipe, self.info = await asyncio.wrap_future(threads[0].run(lambda: self._load(model)))
        self._pipe = pipe
        pipes = [pipe] + [dp.replica_of(pipe) for _ in range(slots - 1)]
        # No torch_threads: each slot picks 1..its share of the cores by timing its
        # denoising steps (which needs the step callback).
        share = max(1, cores() // slots)
        tuned = self.args.torch_threads is None and self.info.takes_step_callback
        self._free = [
            Slot(p, t, ThreadTuner(thread_ladder(share)) if tuned else None)
            for p, t in zip(pipes, threads, strict=True)
        ]
        self.load_time_s = time.perf_counter() - started
        log.info(
            "%s pipeline %s loaded from %s in %.2fs: %s%s",
            self.name,
            self.info.class_name,
            model,
            self.load_time_s,
            self._described(),
            ""
            if self.info.takes_step_callback
            else " (no step callback: no per-step progress or abort)",
        )
        if self.args.warmup:
            await self._warm_up()

    async def _warm_up(self) -> None:
        # The first call pays one-off costs (kernels, allocator) worth seconds; pay them
        # before READY, on the smallest job, not on a client's first request.
        started = time.perf_counter()
        job = self._warmup_job()
        slot = self._free[0]
        try:
            await asyncio.wrap_future(
                slot.thread.run(lambda: self._work_on(slot, job, {}, threading.Event(), _no_hook))
            )
        except Exception as exc:  # a pipeline that cannot make the smallest may make others
            log.warning("warm-up generation failed (%s); continuing without", exc)
            return
        log.info("warm-up generation took %.2fs", time.perf_counter() - started)

    # -- generating ---------------------------------------------------------------------

    async def _prompt(self, request: EngineRequest) -> str:
        """The client's prompt; a stage fed by another (a painter after a thinker) draws
        what its upstream stage wrote, all of it."""
        if request.prompt is not None:
            prompt = prompt_text(request.prompt)
        else:
            prompt = "".join([i.text async for i in request.inputs if i.modality == Modality.TEXT])
        return prompt.strip()

    def _call_fields(self, job: Asked) -> dict[str, Any]:
        """``steps``, ``guidance_scale`` and ``negative_prompt`` of a ``dp.Call``: the
        request's first, then diffusers_call_kwargs, then engine_args defaults, then the
        pipeline's own."""
        call = self.args.diffusers_call_kwargs
        steps = job.num_inference_steps or call.get("num_inference_steps")
        guidance = job.guidance_scale
        if guidance is None:
            guidance = call.get("guidance_scale", self.args.guidance_scale)
        return {
            "steps": int(steps or self.args.num_inference_steps or self._info().default_steps),
            "guidance_scale": guidance,
            "negative_prompt": job.negative_prompt or call.get("negative_prompt"),
        }

    async def _generation(
        self, job: JobT, stream_steps: bool, label: Callable[[], str]
    ) -> Generation[ResultT]:
        """Start ``job`` in a worker thread once a slot is free. Every step bumps
        ``progress`` and is logged every ``log_every_steps`` (``label()`` names the job);
        with ``stream_steps`` the Generation yields it too (with the total the pipeline
        runs: an image edit runs fewer than ``num_inference_steps``)."""
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue[Step] = asyncio.Queue()
        started = time.perf_counter()
        every = self.args.log_every_steps

        def on_step(step: int, total: int) -> None:  # in the worker thread
            self.progress += 1
            if step % every == 0 and step < total:
                rate = dp.it_per_s(step, started)
                log.info("%s: step %d/%d, %.2f it/s", label(), step, total, rate)
            if stream_steps:
                loop.call_soon_threadsafe(steps.put_nowait, (step, total))

        stop = threading.Event()
        return Generation(await self._start(job, stop, on_step), steps, stop)

    async def _start(
        self, job: JobT, stop: threading.Event, on_step: dp.StepHook
    ) -> asyncio.Future[ResultT]:
        """Start ``job`` in a worker thread once a slot is free. The slot (and its
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
                slot.thread.run(lambda: self._work_on(slot, job, call, stop, on_step))
            )
        except BaseException:
            self._release(slot)
            raise

        def done(fut: asyncio.Future[ResultT]) -> None:
            self._release(slot)
            if not fut.cancelled() and isinstance(fut.exception(), dp.Aborted):
                log.info("generation stopped (aborted)")

        work.add_done_callback(done)
        return work

    def _work_on(
        self,
        slot: Slot,
        job: JobT,
        call: dict[str, Any],
        stop: threading.Event,
        on_step: dp.StepHook,
    ) -> ResultT:
        """One job on the slot's thread, its thread count tuned between steps."""
        tuner = slot.tuner
        if tuner is None:
            return self._work(slot, job, call, stop, on_step)
        use_threads(tuner.count)
        size = self._work_size(job)
        last: list[float] = []

        def timed(step: int, total: int) -> None:
            if last:  # from the end of the previous step's hook: one denoising step
                use_threads(tuner.observe(size, time.perf_counter() - last[0]))
            on_step(step, total)
            last[:] = [time.perf_counter()]

        return self._work(slot, job, call, stop, timed)

    def _release(self, slot: Slot) -> None:
        self._free.append(slot)
        self._slots.release()

    def _info(self) -> InfoT:
        if self.info is None:
            raise EngineError(f"the {self.name} engine has not been started")
        return self.info

    async def shutdown(self) -> None:
        self._free.clear()
        self._pipe = None


def _no_hook(_step: int, _total: int) -> None:
    pass

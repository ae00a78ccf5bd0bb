"""What the omni stages share: loading one checkpoint and keeping a part of it, tensors as
chunk payloads, voices, and running transformers' blocking ``generate`` on a worker thread
while the engine streams what it makes.

Each stage runs transformers' own modules, called as
``Qwen2_5OmniForConditionalGeneration.generate`` calls them, so the staged pipeline gives
what the monolithic model gives; the stages differ from it only in where each part runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omnistage.config import hub
from omnistage.config.omni_args import OmniArgs
from omnistage.engines.base import EngineChunk
from omnistage.protocol.chunk_meta import TensorMeta
from omnistage.protocol.enums import Modality
from omnistage.protocol.errors import BadRequestError, ConfigError, EngineError

_TENSOR = Modality.TENSOR
DEFAULT_VOICE = "Chelsie"  # transformers' default speaker for Qwen2.5-Omni
QWEN3_VOICE = "Ethan"  # and for Qwen3-Omni


def device_of(args: OmniArgs) -> str:
    import torch

    if args.device != "auto":
        return args.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def checkpoint_dir(args: OmniArgs) -> str:
    """The local directory of the stage's ``model``: a path as given, or a hub id's
    snapshot (fetched into the HF cache if it is not there)."""
    try:
        return str(hub.resolve(args.model))
    except ConfigError as exc:
        raise EngineError(f"cannot load an omni checkpoint from {exc}") from None


def dtype_of(args: OmniArgs) -> str:
    """The torch dtype name a stage's weights load in: ``dtype``, where "auto" is
    bfloat16 on a cuda device and float32 elsewhere."""
    if args.dtype != "auto":
        return args.dtype
    return "bfloat16" if device_of(args).startswith("cuda") else "float32"


def placement(module: Any) -> str:
    """Where a loaded part computes, as its first weight says: "cuda:0 bfloat16" (the
    engine's ``kernel``, shown per replica in /v1/omni/stages)."""
    weight = next(module.parameters())
    return f"{weight.device} {str(weight.dtype).removeprefix('torch.')}"


# config.json's model_type -> transformers' class of the whole model.
_MODEL_CLASSES = {
    "qwen2_5_omni": "Qwen2_5OmniForConditionalGeneration",
    "qwen3_omni_moe": "Qwen3OmniMoeForConditionalGeneration",
}


def load_omni(args: OmniArgs, directory: str | None = None, dtype: str | None = None) -> Any:
    """The whole checkpoint (speakers included), in eval mode on the CPU, in ``dtype``
    (default: ``dtype_of(args)``); each stage keeps its part and drops the rest. Its
    class follows config.json's model_type. ``directory``: ``checkpoint_dir(args)`` if
    resolved."""
    import torch
    import transformers
    from transformers import AutoConfig

    try:
        where = directory or checkpoint_dir(args)
        kind = AutoConfig.from_pretrained(where).model_type
        if kind not in _MODEL_CLASSES:
            raise ValueError(f"model_type {kind!r} is not an omni model we serve")
        model_class = getattr(transformers, _MODEL_CLASSES[kind])
        model = model_class.from_pretrained(where, dtype=getattr(torch, dtype or dtype_of(args)))
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot load an omni checkpoint from {args.model}: {exc}") from None
    return model.eval()


# The thinker's tensors that size the prompt's media (a spoken input's frames, the images'
# and videos' patch grids, the seconds of a video's temporal patch): the talker's
# positions (its rope) depend on them, as the thinker's do.
MEDIA_SIZES = ("audio_feature_lengths", "image_grid_thw", "video_grid_thw", "video_second_per_grid")


def tensor_chunk(name: str, tensor: Any) -> EngineChunk:
    """A tensor as a chunk: its bytes in C order, its dtype and shape in the meta."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes()
    dtype = str(tensor.dtype).removeprefix("torch.")
    return EngineChunk(_TENSOR, data=data, meta=TensorMeta(name, dtype, tuple(tensor.shape)))


def chunk_tensor(meta: TensorMeta, data: bytes) -> Any:
    """The tensor a ``tensor_chunk`` carries (on the CPU)."""
    import torch

    dtype = getattr(torch, meta.dtype)
    if not data:
        return torch.empty(meta.shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(meta.shape)


def pick_voice(speakers: dict[str, Any], asked: str | None, default: str = DEFAULT_VOICE) -> str:
    """The speaker a request's voice names (any case); "default" or none: ``default`` where
    the checkpoint has it, else its first speaker. Unknown: a 400 listing the voices."""
    if asked is None or asked == "default":
        return default if default in speakers else next(iter(speakers))
    for name in speakers:
        if name.lower() == asked.lower():
            return name
    raise BadRequestError(
        f"voice {asked!r} is not one of this model's voices: {', '.join(speakers)}", "voice"
    )


def qwen3_speakers(model: Any) -> dict[str, int]:
    """A Qwen3-Omni checkpoint's voices (its config's speaker ids, by capitalised name)."""
    voices = model.config.talker_config.speaker_id or {}
    return {name.capitalize(): code for name, code in voices.items()}


class Cancelled(Exception):
    """A request was aborted while its generation ran on the worker thread."""


class ThreadRun:
    """One request's blocking work on the engine's worker thread, and the events it makes
    as an async stream. ``emit`` is called from the worker; ``stopped`` tells it the
    request was aborted (a stopping criterion or a wait checks it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.stopped = threading.Event()

    def emit(self, event: Any) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def events(
        self, executor: ThreadPoolExecutor, work: Callable[[ThreadRun], None]
    ) -> AsyncIterator[Any]:
        """Run ``work(self)`` on ``executor`` and yield what it emits, in order; its
        exception, if any, after the events before it."""
        done = object()

        def run() -> None:
            try:
                work(self)
            except BaseException as exc:
                self.emit(exc)
            finally:
                self.emit(done)

        future = self._loop.run_in_executor(executor, run)
        try:
            while True:
                event = await self._queue.get()
                if event is done:
                    break
                if isinstance(event, BaseException):
                    if isinstance(event, Cancelled):
                        break
                    raise event
                yield event
        finally:
            self.stopped.set()
            await asyncio.shield(future)


def stop_criteria(run: ThreadRun) -> Any:
    """A transformers stopping criterion that ends ``generate`` once ``run`` is aborted."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Aborted(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            aborted = run.stopped.is_set()
            return torch.full((input_ids.shape[0],), aborted, dtype=torch.bool)

    return StoppingCriteriaList([_Aborted()])


class TokenStreamer:
    """transformers' streamer interface: every new token of ``generate`` to ``on_token``
    (the first ``put``, the prompt, is skipped)."""

    def __init__(self, on_token: Callable[[int], None]) -> None:
        self._on_token = on_token
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self._on_token(int(token))

    def end(self) -> None:
        pass

"""The echo engine: deterministic output derived from its input, shaped by its args.

A source stage echoes the prompt plus its suffix, split into ``num_chunks`` chunks; a
streamed prompt (``EngineRequest.prompt_chunks``) piece by piece as it arrives, then the
suffix. A downstream stage passes each upstream chunk through as soon as it arrives (so stages
pipeline) and appends its suffix when its input ends. With ``chunk_delay_s`` and
``cpu_cost_ms`` tests and benchmarks shape the load the way a model would.

With ``prefix_cache_entries`` / ``prefill_ms_per_char`` a source stage fakes an llm
engine's prefix cache for chat prompts: it keeps the prefix keys (``protocol/prefix.py``)
of the prompts it served, reports them (``cached_prefixes``), and before its first chunk
takes time (one prefill at a time) for the part of the prompt its longest cached prefix
does not cover. Its usage
then counts in the head's units, characters (``prefix_weights``): ``prompt_tokens`` is
the prompt's weight and ``cached_tokens`` the weight of the cached prefix, so their ratio
is exactly the cached share the head's routing aims at.
"""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from itertools import islice

import msgspec

from omnistage.config.engine_args import EchoArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine, EngineChunk, EngineRequest, prompt_text
from omnistage.engines.echo_tensors import TensorTally, tensor_chunk
from omnistage.protocol.chunk_meta import TensorMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import EngineError
from omnistage.protocol.messages import Prompt, Usage
from omnistage.protocol.prefix import MAX_REPORTED, prefix_keys, prefix_weights


class EchoEngine(Engine):
    streams_input = True

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args = EchoArgs.model_validate(stage.engine_args)
        self.suffix = self.args.suffix if self.args.suffix is not None else f" [{stage.name}]"
        self._prefilling = asyncio.Lock()
        self.prefix_cache = (
            SimulatedPrefixCache(self.args.prefix_cache_entries)
            if self.args.prefix_cache_entries
            else None
        )

    async def start(self) -> None:
        self._ballast = bytearray(self.args.ballast_mb << 20)
        for offset in range(0, len(self._ballast), 4096):  # resident, not just reserved
            self._ballast[offset] = 1
        for _ in range(self.args.busy_threads):
            threading.Thread(target=_spin_niced, args=(self.args.busy_nice,), daemon=True).start()
        if self.args.start_delay_s:
            # A model's long start, for tests of what the head shows meanwhile.
            self.starting = f"warming up for {self.args.start_delay_s:g}s"
            await asyncio.sleep(self.args.start_delay_s)

    def cached_prefixes(self) -> tuple[int, tuple[int, ...]] | None:
        return self.prefix_cache.snapshot if self.prefix_cache is not None else None

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        modality = self.stage.output_modality
        tensors = _Tensors(modality, self.args.tensor_bytes)
        tally = TensorTally() if self.args.check_tensors else None
        received: list[str] = []
        pieces: list[str]
        prefill: Usage | None = None
        if request.prompt_chunks is not None:
            # A piece may end inside a character: decode across pieces.
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            async for data in request.prompt_chunks:
                text = decoder.decode(data)
                await self._check(text)
                received.append(text)
                if text:
                    await self._work()
                    for chunk in tensors.then(EngineChunk(modality, text=text)):
                        yield chunk
            pieces = [decoder.decode(b"", final=True) + self.suffix]
        elif request.prompt is not None:
            text = self._prompt_text(request.prompt)
            await self._check(text)
            received.append(text)
            prefill = await self._prefill(request.prompt)
            pieces = split_even(text + self.suffix, self.args.num_chunks)
        else:
            async for item in request.inputs:
                if isinstance(item.meta, TensorMeta):
                    if tally is not None:
                        tally.add(item.data)
                    continue
                await self._check(item.text)
                received.append(item.text)
                if item.text:
                    await self._work()
                    for chunk in tensors.then(EngineChunk(modality, text=item.text)):
                        yield chunk
            pieces = [self.suffix + (tally.summary() if tally is not None else "")]
        for piece in pieces[:-1]:
            await self._work()
            for chunk in tensors.then(EngineChunk(modality, text=piece)):
                yield chunk
        await self._work()
        for chunk in tensors.then():
            yield chunk
        # The last piece carries the end of the request: one message fewer per stage.
        words_in = len("".join(received).split())
        completion = words_in + len(self.suffix.split())
        if prefill is None:
            usage = Usage(words_in, completion)
        else:
            usage = msgspec.structs.replace(prefill, completion_tokens=completion)
        yield EngineChunk(
            modality,
            text=pieces[-1],
            finished=True,
            finish_reason=FinishReason.STOP,
            usage=usage,
        )

    async def _prefill(self, prompt: Prompt) -> Usage | None:
        """The simulated prefill of a chat prompt: time for what the cache lacks, then
        the prompt's prefixes cached. The usage it makes (in characters); None when neither
        the cache nor the prefill cost is configured, or the prompt has no messages."""
        args, cache = self.args, self.prefix_cache
        if not prompt.messages or (cache is None and not args.prefill_ms_per_char):
            return None
        keys, weights = prefix_keys(prompt.messages), prefix_weights(prompt.messages)
        # One prefill at a time, as on a replica's own device (but asleep: simulated
        # replicas do not slow each other down); the cache is looked up when the prefill
        # runs, so a prompt queued behind one with the same prefix finds it cached.
        async with self._prefilling:
            hit = cache.longest(keys) if cache is not None else -1
            cached = weights[hit] if hit >= 0 else 0
            if args.prefill_ms_per_char:
                await asyncio.sleep((weights[-1] - cached) * args.prefill_ms_per_char / 1000.0)
            if cache is not None:
                cache.add(keys)
        if cache is None:
            return Usage(weights[-1])
        return Usage(weights[-1], cached_tokens=cached)

    def _prompt_text(self, prompt: Prompt) -> str:
        if self.args.echo_messages and prompt.messages:
            return "\n".join(f"{m.role}: {m.content}" for m in prompt.messages)
        return prompt_text(prompt)

    async def _check(self, text: str) -> None:
        if self.args.fail_on and self.args.fail_on in text:
            raise EngineError(f"echo stage {self.stage.name!r} was told to fail on this input")
        if self.args.hang_on and self.args.hang_on in text:
            await asyncio.Event().wait()  # a wedged engine: cancelled only by an abort

    async def _work(self) -> None:
        if self.args.chunk_delay_s:
            await asyncio.sleep(self.args.chunk_delay_s)
        elif self.args.tensor_bytes:
            # A token per loop tick, as a model's step: each tensor leaves on its own.
            await asyncio.sleep(0)
        if self.args.cpu_cost_ms:
            burn_cpu(self.args.cpu_cost_ms / 1000.0)
        self.progress += 1


class _Tensors:
    """A request's tensors (``tensor_bytes``), one per text chunk, numbered from 0."""

    def __init__(self, modality: Modality, nbytes: int) -> None:
        self.modality, self.nbytes, self.index = modality, nbytes, 0

    def then(self, *chunks: EngineChunk) -> list[EngineChunk]:
        """The next token's tensor (none without ``tensor_bytes``), then ``chunks``."""
        if not self.nbytes:
            return list(chunks)
        self.index += 1
        return [tensor_chunk(self.modality, self.index - 1, self.nbytes), *chunks]


class SimulatedPrefixCache:
    """The prefix keys of the last ``entries`` chat prefixes prefilled, least recently
    used evicted first, as an llm engine's cache would hold them (every prefix of a
    prompt that ends after a message; not the answer). ``snapshot`` is what the heartbeat
    thread reads: a (version, keys most recent first) tuple replaced whole on each change.
    """

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._keys: OrderedDict[int, None] = OrderedDict()
        self.snapshot: tuple[int, tuple[int, ...]] = (0, ())

    def longest(self, keys: Sequence[int]) -> int:
        """The index of the longest of ``keys`` held, or -1."""
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in self._keys:
                return i
        return -1

    def add(self, keys: Sequence[int]) -> None:
        """Cache (or refresh) these prefixes; the longest ends up most recent."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.entries:
            self._keys.popitem(last=False)
        recent = tuple(islice(reversed(self._keys), MAX_REPORTED))
        if recent != self.snapshot[1]:
            self.snapshot = (self.snapshot[0] + 1, recent)


def split_even(text: str, parts: int) -> list[str]:
    """Split into at most ``parts`` non-empty pieces of near-equal length."""
    if not text:
        return [""]
    parts = max(1, min(parts, len(text)))
    size, extra = divmod(len(text), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(text[start:end])
        start = end
    return out


def burn_cpu(seconds: float) -> None:
    """Busy-wait: stands in for model compute that holds the CPU."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _spin_niced(nice: int) -> None:
    """Compute for ever at ``nice`` more than the process's, as a niced worker thread
    does: outside the GIL (hashing a large buffer releases it), as onnxruntime does."""
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    data = bytes(1 << 20)
    while True:
        hashlib.sha256(data).digest()

"""The echo engine: deterministic output derived from its input, shaped by its args.

A source stage echoes the prompt plus its suffix, split into ``num_chunks`` chunks; a
streamed prompt (``EngineRequest.prompt_chunks``) piece by piece as it arrives, then the
suffix. A downstream stage passes each upstream chunk through as soon as it arrives (so stages
pipeline) and appends its suffix when its input ends. With ``chunk_delay_s`` and
``cpu_cost_ms`` tests and benchmarks shape the load the way a model would.
"""

from __future__ import annotations

import asyncio
import codecs
import time
from collections.abc import AsyncIterator

from omnistage.config.engine_args import EchoArgs
from omnistage.config.schema import StageConfig
from omnistage.engines.base import Engine, EngineChunk, EngineRequest, prompt_text
from omnistage.protocol.enums import FinishReason
from omnistage.protocol.errors import EngineError
from omnistage.protocol.messages import Prompt


class EchoEngine(Engine):
    streams_input = True

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args = EchoArgs.model_validate(stage.engine_args)
        self.suffix = self.args.suffix if self.args.suffix is not None else f" [{stage.name}]"

    async def start(self) -> None:
        if self.args.start_delay_s:
            # A model's long start, for tests of what the head shows meanwhile.
            self.starting = f"warming up for {self.args.start_delay_s:g}s"
            await asyncio.sleep(self.args.start_delay_s)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        modality = self.stage.output_modality
        received: list[str] = []
        pieces: list[str]
        if request.prompt_chunks is not None:
            # A piece may end inside a character: decode across pieces.
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            async for data in request.prompt_chunks:
                text = decoder.decode(data)
                await self._check(text)
                received.append(text)
                if text:
                    await self._work()
                    yield EngineChunk(modality, text=text)
            pieces = [decoder.decode(b"", final=True) + self.suffix]
        elif request.prompt is not None:
            text = self._prompt_text(request.prompt)
            await self._check(text)
            received.append(text)
            pieces = split_even(text + self.suffix, self.args.num_chunks)
        else:
            async for item in request.inputs:
                await self._check(item.text)
                received.append(item.text)
                if item.text:
                    await self._work()
                    yield EngineChunk(modality, text=item.text)
            pieces = [self.suffix]
        for piece in pieces[:-1]:
            await self._work()
            yield EngineChunk(modality, text=piece)
        await self._work()
        # The last piece carries the end of the request: one message fewer per stage.
        words_in = len("".join(received).split())
        yield EngineChunk(
            modality,
            text=pieces[-1],
            finished=True,
            finish_reason=FinishReason.STOP,
            usage={
                "prompt_tokens": words_in,
                "completion_tokens": words_in + len(self.suffix.split()),
            },
        )

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
        if self.args.cpu_cost_ms:
            burn_cpu(self.args.cpu_cost_ms / 1000.0)
        self.progress += 1


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

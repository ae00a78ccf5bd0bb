"""Pacing a sequence's streamed text: at most one delivery per interval.

Every delivery costs the same whatever it carries: a wake-up of the replica's event
loop, a message to the head, an SSE event, a client read. A decode step of ~4 ms at one
sequence pays that per token, on the cores the step itself runs on (served c=1 then
lost 5-15% against the engine alone). Text produced within ``interval_s`` of the last
delivery is held and goes out merged with the next: the first ``OPENING`` tokens go out
at once, and so does the last (with the finish); a held piece waits at most one more
step. A step slower than the interval (a busy batch) delivers every token as before.

Why the opening goes unpaced: a talker speaks an answer's opening phrase (three words
or more, cut when the boundary word after them appears: ~5 tokens) as soon as it has
them, and the listener is waiting for that audio. A held token there delayed the phrase
by a whole decode step (~7 ms on a busy voice turn) for a saving of a few messages per
answer.

Pure state: the worker passes the time.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.engines.base import EngineChunk

OPENING = 8  # tokens delivered as they come, before pacing starts


@dataclass
class StreamPace:
    """One sequence's held text, and when its last delivery left."""

    interval_s: float
    held: EngineChunk | None = None
    sent_at: float = float("-inf")
    offered: int = 0  # chunks offered so far (a chunk is a token's text)

    def offer(self, chunk: EngineChunk, now: float) -> EngineChunk | None:
        """What to deliver now, given the next ``chunk`` (None: it is held)."""
        self.offered += 1
        if self.held is not None:
            chunk = merged(self.held, chunk)
            self.held = None
        if chunk.finished or self.offered <= OPENING or now - self.sent_at >= self.interval_s:
            self.sent_at = now
            return chunk
        self.held = chunk
        return None

    def take(self, now: float) -> EngineChunk | None:
        """The held text, to deliver now (before a long prefill or a failure)."""
        chunk, self.held = self.held, None
        if chunk is not None:
            self.sent_at = now
        return chunk


def merged(a: EngineChunk, b: EngineChunk) -> EngineChunk:
    """``a`` then ``b`` as one text chunk: ``b``'s usage (it counts both), finish and
    logprobs after ``a``'s."""
    logprobs = a.logprobs
    if b.logprobs is not None:
        logprobs = [*(logprobs or ()), *b.logprobs]
    return EngineChunk(
        a.modality,
        text=a.text + b.text,
        finished=b.finished,
        finish_reason=b.finish_reason,
        usage=b.usage or a.usage,
        logprobs=logprobs,
    )

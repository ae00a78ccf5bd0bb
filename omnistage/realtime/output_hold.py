"""An answer's audio held back while the user may be interrupting it.

When the user starts to speak over an answer, its audio stops going out at once, but
the answer goes on being made: its audio deltas wait here, in order. If the speech was
a backchannel ("uh-huh") or a noise, ``release`` sends them and the answer flows on
from where it paused, nothing lost or repeated; if it was a request, ``drop`` forgets
them and the answer is cancelled as far as its audio went out.

A client that truncates the answer while it is still being made (Pipecat does at
``speech_started``, a WebRTC call's track at once) dropped the audio it had past the
cut: ``rewind`` sends that again, ahead of what is held, so the answer goes on from
exactly where the client cut it (the truncate removed the unheard audio; what follows
is new audio of the item).

Only audio waits: the transcript and the other events go on (a client shows words ahead
of the audio anyway), and an answer does not finish while its audio is held
(``ResponseRun.run`` waits for ``released``), so its done events come after its audio.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from omnistage.realtime.events import ServerEvent

# An audio delta: its event, the ms of the answer it carries and its bytes (as sent).
_Delta = tuple[ServerEvent, float, bytes]


class AudioHold:
    def __init__(self, emit: Callable[[ServerEvent], None]) -> None:
        self._emit = emit
        self._held: list[_Delta] | None = None  # None: not held
        self._free = asyncio.Event()
        self._free.set()
        self.sent_ms = 0.0  # the audio that went out
        self._sent = bytearray()  # its bytes, to send again past a client's truncate

    @property
    def holding(self) -> bool:
        return self._held is not None

    def audio(self, event: ServerEvent, ms: float, data: bytes) -> None:
        """An audio delta of ``ms`` of audio (``data``, as encoded): out now, or held."""
        if self._held is not None:
            self._held.append((event, ms, data))
        else:
            self._send(event, ms, data)

    def _send(self, event: ServerEvent, ms: float, data: bytes) -> None:
        self._emit(event)
        self.sent_ms += ms
        self._sent += data

    def rewind(self, kept: int, delta: Callable[[bytes], ServerEvent]) -> None:
        """The client kept only the first ``kept`` bytes of the audio sent: the rest goes
        out again (as one ``delta``), before anything held, once the audio flows."""
        again = bytes(self._sent[kept:])
        if not again:
            return
        ms = self.sent_ms * len(again) / len(self._sent)
        del self._sent[kept:]
        self.sent_ms -= ms
        if self._held is not None:
            self._held.insert(0, (delta(again), ms, again))
        else:
            self._send(delta(again), ms, again)

    def hold(self) -> None:
        if self._held is None:
            self._held = []
            self._free.clear()

    def release(self) -> None:
        """Send what was held, and whatever comes next as it comes."""
        held, self._held = self._held or [], None
        for event, ms, data in held:
            self._send(event, ms, data)
        self._free.set()

    def drop(self) -> None:
        """Forget what was held: it is never sent."""
        self._held = None
        self._free.set()

    async def released(self) -> None:
        await self._free.wait()

"""An answer's audio held back while the user may be interrupting it.

When the user starts to speak over an answer, its audio stops going out at once, but
the answer goes on being made: its audio deltas wait here, in order. If the speech was
a backchannel ("uh-huh") or a noise, ``release`` sends them and the answer flows on
from where it paused, nothing lost or repeated; if it was a request, ``drop`` forgets
them and the answer is cancelled as far as its audio went out.

Only audio waits: the transcript and the other events go on (a client shows words ahead
of the audio anyway), and an answer does not finish while its audio is held
(``ResponseRun.run`` waits for ``released``), so its done events come after its audio.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from omnistage.realtime.events import ServerEvent


class AudioHold:
    def __init__(self, emit: Callable[[ServerEvent], None]) -> None:
        self._emit = emit
        self._held: list[tuple[ServerEvent, float]] | None = None  # None: not held
        self._free = asyncio.Event()
        self._free.set()
        self.sent_ms = 0.0  # the audio that went out

    @property
    def holding(self) -> bool:
        return self._held is not None

    def audio(self, event: ServerEvent, ms: float) -> None:
        """An audio delta of ``ms`` of audio: out now, or held."""
        if self._held is not None:
            self._held.append((event, ms))
        else:
            self._emit(event)
            self.sent_ms += ms

    def hold(self) -> None:
        if self._held is None:
            self._held = []
            self._free.clear()

    def release(self) -> None:
        """Send what was held, and whatever comes next as it comes."""
        held, self._held = self._held or [], None
        for event, ms in held:
            self._emit(event)
            self.sent_ms += ms
        self._free.set()

    def drop(self) -> None:
        """Forget what was held: it is never sent."""
        self._held = None
        self._free.set()

    async def released(self) -> None:
        await self._free.wait()

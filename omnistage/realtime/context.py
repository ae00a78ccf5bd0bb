"""What a session runs on (``SessionContext``), and what its parts may use of it
(``SessionHost``).

The session's parts (``answers.Answers``, ``turn_taking.TurnTaking``) see the session
only through ``SessionHost``: its settings, conversation and pipeline, the way out for
server events, and its background tasks. They never import the session, so the session
sits above them and nothing below it reaches back up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from omnistage.audio.vad import VadParams, VadStream
from omnistage.audio.verdicts import shared_pool
from omnistage.realtime.config import SessionConfig
from omnistage.realtime.conversation import Conversation, Item
from omnistage.realtime.events import ServerEvent
from omnistage.realtime.input_buffer import RATE
from omnistage.service import PipelineService


class Stats(Protocol):
    def turn(self) -> None: ...
    def barge_in(self) -> None: ...
    def first_audio(self, seconds: float) -> None: ...


class _NoStats:
    def turn(self) -> None: ...
    def barge_in(self) -> None: ...
    def first_audio(self, seconds: float) -> None: ...


@dataclass
class SessionContext:
    """What a session runs on: the pipeline and which stage does what."""

    service: PipelineService
    thinker: int
    talker: int | None
    listener: int | None
    stats: Stats = field(default_factory=_NoStats)
    # The end-of-turn model runs on the process's worker pool, off the event loop.
    vad: Callable[[VadParams], VadStream] = lambda p: VadStream(p, RATE, verdicts=shared_pool())
    # What ``rate_limits.updated`` reports after each answer (None: nothing is sent).
    rate_limits: Callable[[], list[dict[str, Any]]] | None = None
    # The thinker hears the user's audio itself (an omni model's): no listener, and
    # each turn's audio is kept for the answer's prompt.
    hears: bool = False
    # The stages besides the talker that take the answer's voice.
    speakers: tuple[int, ...] = ()
    # Whether the process has cores to spare for guessed transcriptions (user_turn).
    guess: Callable[[], bool] = lambda: False
    # The probability that a turn's words so far end it, given the assistant's last
    # words (``words_turn.WordsJudge``: a reply to a question is read as one; None from
    # it: no verdict). None: semantic_vad hears how, not what, the user said.
    words: Callable[[str, str], Awaitable[float | None]] | None = None


class Playback(Protocol):
    """Where the server plays the answers itself (a WebRTC call's track): an answer all
    made may still be playing there, and speech over it pauses it, not the answer."""

    @property
    def sounding(self) -> bool:
        """An answer's audio is playing, or queued to play."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...

    def cut(self) -> None:
        """Drop what is left to play; the answer's item keeps what was played."""


class SessionHost(Protocol):
    """The session as its parts see it."""

    @property
    def id(self) -> str: ...
    @property
    def ctx(self) -> SessionContext: ...
    @property
    def config(self) -> SessionConfig: ...
    @property
    def conversation(self) -> Conversation: ...
    @property
    def playback(self) -> Playback | None:
        """Where the server plays the answers itself (None: the client plays them)."""

    def emit(self, event: ServerEvent) -> None:
        """Send ``event`` to the client (it gets the session's next event id)."""

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as the session's: cancelled when the session closes."""

    def add_answer_item(self, item: Item) -> None:
        """An answer's output item joins the conversation (and the client hears of it)."""

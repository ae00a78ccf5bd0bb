"""Start-up: which stages still wait for a live replica, and when to give up. Pure, with
an injected clock; the head's shell polls it and acts on what it says."""

from __future__ import annotations

import enum
from collections.abc import Callable


class Verdict(enum.Enum):
    WAITING = "waiting"
    NOTE = "note"  # still waiting: time to say so in the log
    SERVING = "serving"  # every stage has a live replica
    FAILED = "failed"  # --init-timeout passed


class StartupWatch:
    def __init__(
        self, clock: Callable[[], float], init_timeout_s: float, note_every_s: float = 10.0
    ) -> None:
        self._clock = clock
        self.init_timeout_s = init_timeout_s
        self._deadline = clock() + init_timeout_s
        self._note_every_s = note_every_s
        self._next_note = clock() + note_every_s

    def judge(self, missing: list[tuple[int, str]]) -> Verdict:
        """The verdict for the stages that have no live replica now."""
        if not missing:
            return Verdict.SERVING
        now = self._clock()
        if now > self._deadline:
            return Verdict.FAILED
        if now > self._next_note:
            self._next_note = now + self._note_every_s
            return Verdict.NOTE
        return Verdict.WAITING


def stage_names(missing: list[tuple[int, str]]) -> str:
    return ", ".join(f"{sid} ({name})" for sid, name in missing)

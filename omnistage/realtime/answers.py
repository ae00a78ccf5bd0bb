"""A session's answers: the one the conversation waits on, out-of-band ones beside it,
``response.create`` / ``response.cancel``, and the end of speech -> first audio timing.

The session owns one ``Answers``; turn taking (``turn_taking``) starts answers through
it, and the client's events reach it through the session. It sees the session only as
a ``SessionHost``.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from omnistage.protocol.messages import Prompt
from omnistage.realtime.context import SessionHost
from omnistage.realtime.conversation import Item, chat_prompt, check_item
from omnistage.realtime.gate import Gate
from omnistage.realtime.options import SessionKind, bad
from omnistage.realtime.replies import ResponseSettings, reply_settings
from omnistage.realtime.response_run import ResponseRun, StopReason


@dataclass
class AnswerRequest:
    """A checked ``response.create``: the answer's settings, the items it answers (None:
    the conversation) and its instructions (None: the session's)."""

    settings: ResponseSettings
    items: list[Item] | None
    instructions: str | None


class Answers:
    def __init__(self, host: SessionHost) -> None:
        self._host = host
        self.active: ResponseRun | None = None  # the conversation's answer under way
        self._runs: dict[str, ResponseRun] = {}

    @property
    def answering(self) -> bool:
        return self.active is not None and not self.active.done

    def check(self, params: dict[str, Any]) -> AnswerRequest:
        """``response.create``'s ``response``, checked against the session's state."""
        config = self._host.config
        if config.kind == SessionKind.TRANSCRIPTION:
            raise bad("type", "a transcription session does not create responses")
        settings = reply_settings(config, params)
        if settings.in_conversation and self.answering:
            assert self.active is not None
            raise bad(
                "",
                f"Conversation already has an active response in progress: {self.active.id}",
                "conversation_already_has_active_response",
            )
        inputs = params.get("input")
        items = self._input_items(inputs) if inputs is not None else None
        return AnswerRequest(settings, items, params.get("instructions"))

    def _input_items(self, inputs: Any) -> list[Item]:
        if not isinstance(inputs, list):
            raise bad("response.input", "expected a list of items")
        out = []
        for i, value in enumerate(inputs):
            if isinstance(value, dict) and value.get("type") == "item_reference":
                ref = str(value.get("id"))
                out.append(self._host.conversation.get(ref, f"response.input[{i}].id"))
            else:
                out.append(check_item(value, f"response.input[{i}]"))
        return out

    def new_run(
        self,
        settings: ResponseSettings,
        items: list[Item] | None,
        instructions: str | None,
        gate: Gate | None = None,
    ) -> ResponseRun:
        host, ctx = self._host, self._host.ctx
        text = instructions if instructions is not None else host.config.instructions

        def prompt() -> Prompt:
            answered = items if items is not None else list(host.conversation)
            return chat_prompt(text, answered, ctx.hears)

        return ResponseRun(
            ctx.service,
            (ctx.thinker, ctx.talker),
            settings,
            prompt,
            gate.emit if gate is not None else host.emit,
            on_item=gate.add_item if gate is not None else host.add_answer_item,
            affinity=host.id,
            rate_limits=ctx.rate_limits,
            speakers=ctx.speakers,
        )

    def start(
        self,
        settings: ResponseSettings,
        items: list[Item] | None,
        instructions: str | None,
        spoken_end: float | None,
        before: Awaitable[None] | None = None,
    ) -> None:
        run = self.new_run(settings, items, instructions)
        if settings.in_conversation:
            self.active = run
        if spoken_end is not None:
            self.time_first_audio(run, spoken_end)
        run.created()
        self.run(run, before)

    def run(self, run: ResponseRun, before: Awaitable[None] | None) -> None:
        """Run ``run`` in the background (``before`` first) as one of the session's."""

        async def running() -> None:
            self._runs[run.id] = run
            try:
                await run.run(before)
            finally:
                self._runs.pop(run.id, None)

        self._host.spawn(running())

    def adopt(self, run: ResponseRun) -> None:
        """An answer started early is the conversation's answer now."""
        self.active = run

    def time_first_audio(
        self, run: ResponseRun, spoken_end: float, released: float | None = None
    ) -> None:
        """Record end of speech -> first answer audio sent. An early answer's audio went
        out when its gate opened (``released``), if it was made before."""
        stats = self._host.ctx.stats

        def record(made: float) -> None:
            stats.first_audio(max(made, released or made) - spoken_end)

        if run.first_audio_at is not None:
            record(run.first_audio_at)
        else:
            run.on_first_audio = record

    def cancel(self, response_id: str | None) -> None:
        """``response.cancel``."""
        run = self._runs.get(response_id) if response_id else self.active
        if run is None or run.done:
            raise bad(
                "response_id" if response_id else "",
                "Cancellation failed: no active response found",
                "response_cancel_not_active",
            )
        run.cancel(StopReason.CLIENT_CANCELLED)

    def cancel_all(self) -> None:
        for run in list(self._runs.values()):
            run.cancel(StopReason.CLIENT_CANCELLED)

"""The clients of ``bench_chaos --kill heads|api``: what a user's code would run against
heads that die under it.

- **Chats**: the openai SDK (``AsyncOpenAI``, its default 2 retries on), streaming text
  and audio. A request that fails before its stream starts (no 200 yet) is re-sent by
  haproxy (its ``retry-on``) or else by the SDK; if even that fails, it is *lost* (the
  target is none). A stream that started and then broke cannot be re-sent by anyone but
  the client: this client asks again, up to ``STREAM_RETRIES`` times, and counts it.
- **Realtime sessions**: the SDK's ``realtime.connect`` with its own reconnect
  (``on_reconnecting``) given the session's id and resume token (our extension), so a
  dropped connection reconnects through haproxy and resumes the same session. An answer
  under way when the connection dropped is asked again on the resumed session.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass, field
from typing import Any

import common
import httpx
import openai
from bench_chaos import QUESTIONS, RATE, chat_body
from bench_realtime import Turn

STREAM_RETRIES = 3  # a broken stream asked again (the client's, not the SDK's)
ANSWER_TIMEOUT_S = 300.0


@dataclass
class ChatRequest:
    kind: str  # "chat typed" / "chat spoken" / "realtime"
    phase: str
    ok: bool
    wait_s: float | None = None  # first try sent -> first audio of the answer given
    stall_s: float = 0.0  # of the answer given
    sdk_retries: int = 0  # attempts the SDK re-sent (a failure before any stream)
    broken: int = 0  # streams (or realtime answers) that started and then broke
    lost_before_stream: bool = False  # failed at the client before any stream started
    error: str = ""


@dataclass
class Session:
    drops: int = 0
    resumed: int = 0
    not_resumed: int = 0
    resume_waits: list[float] = field(default_factory=list)  # drop -> session.created


@dataclass
class Clients:
    phase: str = "baseline"
    requests: list[ChatRequest] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # every failed attempt, for the log


def sdk_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", timeout=ANSWER_TIMEOUT_S)


async def _stream(sdk: openai.AsyncOpenAI, body: dict[str, Any], turn: Turn) -> int:
    """One try: the SDK's retries taken before the stream. Raises ``_Broken`` when the
    stream started and then failed, any OpenAIError when it never started."""
    raw = await sdk.chat.completions.with_raw_response.create(**body)
    stream = raw.parse()  # with_raw_response's parse is not async, for a stream too
    try:
        async for chunk in stream:
            for choice in chunk.choices:
                audio = choice.delta.audio  # a typed ChoiceDeltaAudio in this SDK
                if audio is not None and audio.data:
                    n = len(base64.b64decode(audio.data))
                    turn.deltas.append((time.monotonic(), n / 2 / RATE))
    except (openai.OpenAIError, httpx.HTTPError) as exc:
        raise _Broken(raw.retries_taken, exc) from exc
    return raw.retries_taken


class _Broken(Exception):
    def __init__(self, retries: int, cause: BaseException) -> None:
        super().__init__(common.describe(cause))
        self.retries = retries


async def one_chat(sdk: openai.AsyncOpenAI, body: dict[str, Any], kind: str, c: Clients):
    req, sent = ChatRequest(kind, c.phase, False), time.monotonic()
    for _ in range(1 + STREAM_RETRIES):
        turn = Turn()
        turn.end_of_speech = sent
        try:
            req.sdk_retries += await _stream(sdk, body, turn)
        except _Broken as exc:
            req.sdk_retries += exc.retries
            req.broken += 1
            c.errors.append(f"{kind} stream broke: {exc}")
            continue
        except openai.OpenAIError as exc:
            req.lost_before_stream, req.error = True, common.describe(exc)
            c.errors.append(f"{kind} lost before its stream: {req.error}")
            break
        req.ok, req.wait_s, req.stall_s = True, turn.first_audio_s, turn.stall_s()
        break
    else:
        req.error = "stream broke every time"
    c.requests.append(req)


async def chat_client(url: str, wavs: list[str], stop: asyncio.Event, c: Clients) -> None:
    async with sdk_client(url) as sdk:
        n = 0
        while not stop.is_set():
            q = n % len(QUESTIONS)
            wav = wavs[q] if n % 2 else None
            body = chat_body(QUESTIONS[q], wav)
            await one_chat(sdk, body, "chat spoken" if wav else "chat typed", c)
            n += 1


class Resuming:
    """One realtime session: a reader task puts its events on a queue (a resumed
    ``session.created`` too, which tells the answer under way it was cut)."""

    def __init__(self, conn: Any, session: Session) -> None:
        self.conn, self.session = conn, session
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.id = self.token = ""
        self.dropped_at: float | None = None
        self.replayed: set[str] = set()  # items a resume replayed: deleted after the answer
        self.resuming = False

    def on_reconnecting(self, event: Any) -> dict[str, Any]:
        if event.attempt == 1:
            self.session.drops += 1
            self.dropped_at = time.monotonic()
        return {"extra_query": {"session_id": self.id, "resume_token": self.token}}

    async def read(self) -> None:
        try:
            async for event in self.conn:
                if event.type == "session.created":
                    resume = (event.model_extra or {}).get("resume") or {}
                    if not self.id:  # the session's first: not news to the answer
                        self.id, self.token = event.session.id, resume["token"]
                        continue
                    if resume.get("resumed"):
                        self.session.resumed += 1
                        self.session.resume_waits.append(time.monotonic() - (self.dropped_at or 0))
                        self.resuming = True
                elif event.type == "conversation.item.done" and self.resuming:
                    self.replayed.add(event.item.id)
                elif event.type == "response.created":
                    self.resuming = False
                await self.events.put(event)
        except Exception as exc:  # the SDK gave up reconnecting: the session is gone
            await self.events.put(exc)
        else:
            await self.events.put(ConnectionError("the session closed"))


async def realtime_answer(r: Resuming, n: int, c: Clients) -> None:
    req, sent = ChatRequest("realtime", c.phase, False), time.monotonic()
    for attempt in range(1 + STREAM_RETRIES):
        item_id = f"item_q{n}_{attempt}"
        item = {
            "id": item_id,
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": QUESTIONS[n % len(QUESTIONS)]}],
        }
        await r.conn.conversation.item.create(item=item)
        await r.conn.response.create()
        turn = Turn()
        turn.end_of_speech = sent
        while True:
            event = await asyncio.wait_for(r.events.get(), ANSWER_TIMEOUT_S)
            if isinstance(event, Exception):
                req.error = common.describe(event)
                c.requests.append(req)
                raise event
            if event.type == "session.created":  # resumed: this answer was cut
                req.broken += 1
                c.errors.append("realtime answer cut by a drop; asked again after the resume")
                break
            if event.type == "response.output_audio.delta":
                n_bytes = len(base64.b64decode(event.delta))
                turn.deltas.append((time.monotonic(), n_bytes / 2 / RATE))
            elif event.type == "error" and "not found" not in str(event.error).lower():
                c.errors.append(f"realtime error event: {event.error}")
            elif event.type == "response.done":
                req.ok = event.response.status == "completed"
                req.error = "" if req.ok else f"status {event.response.status}"
                req.wait_s, req.stall_s = turn.first_audio_s, turn.stall_s()
                c.requests.append(req)
                outs = [o.id for o in event.response.output or []]
                stale = r.replayed - {item_id, *outs}
                r.replayed.clear()
                for old in [item_id, *outs, *sorted(stale)]:  # keep the conversation short
                    await r.conn.conversation.item.delete(item_id=old)
                return
    req.error = "cut every time"
    c.requests.append(req)


async def realtime_client(url: str, stop: asyncio.Event, c: Clients) -> None:
    while not stop.is_set():
        session = Session()
        c.sessions.append(session)
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        holder: list[Resuming] = []  # the reconnect hook needs the session's id and token
        manager = sdk.realtime.connect(
            model="voice",
            on_reconnecting=lambda event, h=holder: h[0].on_reconnecting(event),
            max_retries=8,
        )
        try:
            async with manager as conn:
                r = Resuming(conn, session)
                holder.append(r)
                reader = asyncio.create_task(r.read())
                await conn.session.update(
                    session={"type": "realtime", "output_modalities": ["audio"]}
                )
                n = 0
                while not stop.is_set():
                    await realtime_answer(r, n, c)
                    n += 1
                reader.cancel()
        except Exception as exc:  # not resumed: counted, and a new session goes on
            session.not_resumed += 1
            c.errors.append(f"realtime session lost: {common.describe(exc)}")

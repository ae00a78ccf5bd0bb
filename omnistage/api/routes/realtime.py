"""GET /v1/realtime: OpenAI's Realtime API over a WebSocket (``realtime.session``).

This module owns the socket: the handshake (model, the session limit, the ``realtime``
subprotocol), one reader feeding client frames to the session, one writer sending its
events, the idle timeout, and freeing everything when the client goes.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from starlette.websockets import WebSocket, WebSocketDisconnect

from omnistage import defaults
from omnistage.api import realtime_resume as resume
from omnistage.api.errors import error_response
from omnistage.audio import smart_turn
from omnistage.audio.vad import load_silero
from omnistage.protocol.enums import EngineName, Modality
from omnistage.protocol.errors import BadRequestError
from omnistage.realtime import saved
from omnistage.realtime.config import SessionConfig
from omnistage.realtime.context import SessionContext
from omnistage.realtime.events import MAX_EVENT_BYTES, ServerEvent
from omnistage.realtime.session import RealtimeSession
from omnistage.realtime.user_turn import GUESS_MAX_SESSIONS
from omnistage.realtime.words_turn import WordsJudge
from omnistage.service import PipelineService
from omnistage.store.base import Store
from omnistage.store.records import RealtimeRecord

router = APIRouter()

PATH = "/v1/realtime"
# A client that reads nothing while answers stream is dropped past this many events.
MAX_QUEUED_EVENTS = 4096
_encode = msgspec.json.Encoder().encode


@dataclass
class RealtimeLimits:
    """Per API process: sessions at once, and how long a silent client is kept."""

    max_sessions: int = defaults.REALTIME_MAX_SESSIONS
    idle_timeout_s: float = defaults.REALTIME_IDLE_TIMEOUT_S
    # How long a session stays resumable after its last change (0: none are saved).
    resume_ttl_s: float = defaults.REALTIME_RESUME_TTL_S
    live: int = 0


def limits_of(ws: WebSocket | Request) -> RealtimeLimits:
    state = ws.app.state
    if not hasattr(state, "realtime_limits"):
        state.realtime_limits = RealtimeLimits()
    return state.realtime_limits  # type: ignore[no-any-return]


class Refusal(Exception):
    """Why a session cannot open: an HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None, code: str | None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def prepare(
    omni: PipelineService, limits: RealtimeLimits, model: str | None, minted: Any
) -> tuple[SessionContext, SessionConfig]:
    """A new session's context and config, as the WebSocket and WebRTC routes both open
    one: the model served, a text stage to answer with, a free session slot, and the
    session config a client secret carries; else a ``Refusal``."""
    if model is not None and model not in omni.model_names:
        names = ", ".join(sorted(omni.model_names))
        message = f"The model `{model}` does not exist; this server serves {names}"
        raise Refusal(404, message, "model", "model_not_found")
    ctx = _context(omni)
    if ctx is None:
        message = f"pipeline {omni.config.pipeline!r} has no text stage to answer with"
        raise Refusal(404, message, None, "no_realtime_pipeline")
    ctx.rate_limits = lambda: _rate_limits(limits)
    ctx.guess = lambda: limits.live <= GUESS_MAX_SESSIONS
    if limits.live >= limits.max_sessions:
        message = f"too many realtime sessions: this server holds {limits.max_sessions}"
        raise Refusal(429, message, None, "session_limit_reached")
    config = SessionConfig(model=model or omni.served_model)
    if ctx.talker is None:
        config.output_modalities = (Modality.TEXT,)
    if (voice := _default_voice(omni, ctx)) is not None:
        config.voice = voice
    try:
        if minted:
            config.update(minted)
    except BadRequestError as exc:
        raise Refusal(400, str(exc), exc.param, exc.code) from None
    return ctx, config


@router.websocket(PATH)
async def realtime(ws: WebSocket) -> None:
    omni: PipelineService = ws.app.state.omni
    limits = limits_of(ws)
    minted = ws.scope.get("state", {}).get("realtime_session")
    try:
        ctx, config = prepare(omni, limits, ws.query_params.get("model"), minted)
    except Refusal as no:
        return await _refuse(ws, no.status, no.message, no.param, no.code)
    # The slot is taken before the first await: handshakes at once cannot all pass.
    limits.live += 1
    try:
        store = resume.store_of(ws, limits.resume_ttl_s)
        try:
            resumed = await resume.load(ws, store)
        except resume.ResumeRefused as no:
            return await _refuse(ws, no.status, no.message, resume.SESSION_PARAM, no.code)
        try:
            if resumed is not None:
                saved.restore_config(config, resumed[0].config)
        except BadRequestError as exc:  # saved by a server that took more than this one
            return await _refuse(ws, 400, str(exc), exc.param, exc.code)
        await _accept(ws, ctx, config, limits, (store, resumed))
    finally:
        limits.live -= 1


Saved = tuple[Store | None, tuple[RealtimeRecord, str] | None]


async def _accept(
    ws: WebSocket,
    ctx: SessionContext,
    config: SessionConfig,
    limits: RealtimeLimits,
    saving: Saved = (None, None),
) -> None:
    await load_vad(config)
    offered = ws.scope.get("subprotocols") or []
    await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
    stats = getattr(ws.app.state, "realtime_stats", None)
    if stats is not None:
        ctx.stats = stats
        stats.session_opened()
    try:
        await _serve(ws, ctx, config, limits, saving)
    finally:
        if stats is not None:
            stats.session_closed()


async def load_vad(config: SessionConfig) -> None:
    if config.turn_detection is not None:
        # The first session of a process loads Silero: in a thread, not on the loop.
        await asyncio.to_thread(load_silero)
    if smart_turn.available():
        # And Smart Turn, which a session.update may ask for (/talk does, at once).
        await asyncio.to_thread(smart_turn.load_smart_turn)


def _rate_limits(limits: RealtimeLimits) -> list[dict[str, Any]]:
    """The one limit this server has: sessions at once (``--realtime-max-sessions``),
    reported as OpenAI's ``requests`` limit, with how many more it would take now."""
    left = max(0, limits.max_sessions - limits.live)
    return [
        {"name": "requests", "limit": limits.max_sessions, "remaining": left, "reset_seconds": 0}
    ]


def _context(omni: PipelineService) -> SessionContext | None:
    graph = omni.graph
    text = graph.finals_with({Modality.TEXT})
    if not text:
        return None
    audio = graph.finals_with({Modality.AUDIO})
    talker = audio[0] if audio else None
    listeners = graph.stages_reading(Modality.AUDIO)
    # A thinker that takes audio (an omni model's) hears the user itself; otherwise a
    # listener (ASR) stage writes down what the thinker reads.
    hears = text[0] in listeners
    speakers = graph.speaking_for([talker]) - {talker} if talker is not None else set()
    return SessionContext(
        omni,
        thinker=text[0],
        talker=talker,
        listener=listeners[0] if listeners and not hears else None,
        hears=hears,
        speakers=tuple(sorted(speakers)),
        # A thinker that hears the audio itself has no words to judge before it answers.
        words=None if hears else WordsJudge(omni, text[0]),
    )


def _default_voice(omni: PipelineService, ctx: SessionContext) -> str | None:
    """The session's voice where OpenAI's default ("alloy") is no voice of the
    pipeline's: a speaker that is no TTS stage (which maps OpenAI's voice names) is
    given "default", its own first voice. None: OpenAI's default stands."""
    if ctx.talker is None:
        return None
    engines = {omni.graph.stages[sid].engine for sid in (ctx.talker, *ctx.speakers)}
    return None if EngineName.TTS in engines else "default"


async def _serve(
    ws: WebSocket,
    ctx: SessionContext,
    config: SessionConfig,
    limits: RealtimeLimits,
    saving: Saved,
) -> None:
    outbox: asyncio.Queue[ServerEvent | None] = asyncio.Queue()
    overflow = asyncio.Event()

    def send(event: ServerEvent) -> None:
        if outbox.qsize() >= MAX_QUEUED_EVENTS:
            overflow.set()
            return
        outbox.put_nowait(event)

    store, resumed = saving
    session = RealtimeSession(ctx, config, send, resumed[0].id if resumed else None)
    if resumed is not None:
        session.restore(resumed[0].items)
    writer = asyncio.ensure_future(_write(ws, outbox))

    def lost() -> None:  # resumed on another connection: this one ends
        session.error(BadRequestError(resume.LOST, code=resume.LOST_CODE))
        outbox.put_nowait(None)
        session.spawn(_close_after(writer, ws))

    saver, resume_info = await resume.attach(store, ws, session, resumed, limits.resume_ttl_s, lost)
    session.opened(resume_info)
    try:
        await _read(ws, session, writer, overflow, limits.idle_timeout_s)
    finally:
        await session.close()
        if saver is not None:
            await saver.close()
        outbox.put_nowait(None)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer, 1.0)
        writer.cancel()
        with contextlib.suppress(Exception):
            await ws.close()


async def _read(
    ws: WebSocket,
    session: RealtimeSession,
    writer: asyncio.Future[None],
    overflow: asyncio.Event,
    idle_timeout_s: float,
) -> None:
    while not writer.done() and not overflow.is_set():
        try:
            message = await asyncio.wait_for(ws.receive(), idle_timeout_s)
        except TimeoutError:
            session.error(
                BadRequestError(
                    f"the session was idle for {idle_timeout_s:.0f} s and is closed",
                    code="session_idle_timeout",
                )
            )
            return
        except (WebSocketDisconnect, RuntimeError):
            return
        if message["type"] == "websocket.disconnect":
            return
        frame = message.get("text")
        if frame is None:
            frame = message.get("bytes") or b""
        if len(frame) > MAX_EVENT_BYTES:
            session.error(
                BadRequestError(
                    f"an event may be at most {MAX_EVENT_BYTES} bytes, got {len(frame)}",
                    code="event_too_large",
                )
            )
            continue
        await session.handle(frame)


async def _write(ws: WebSocket, outbox: asyncio.Queue[ServerEvent | None]) -> None:
    while (event := await outbox.get()) is not None:
        await ws.send_text(_encode(event).decode())


async def _close_after(writer: asyncio.Future[None], ws: WebSocket) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer, 1.0)
    with contextlib.suppress(Exception):
        await ws.close()


async def _refuse(
    ws: WebSocket, status: int, message: str, param: str | None, code: str | None
) -> None:
    """Refuse the handshake with an HTTP status and OpenAI's error body, where the server
    can send one (the ASGI denial extension); else close before accepting (a 403)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        response = error_response(status, message, "invalid_request_error", param, code)
        await ws.send_denial_response(response)
        return
    await ws.close(code=1008, reason=message[:120])

"""One Realtime call over WebRTC: a peer connection around the same ``RealtimeSession``
the WebSocket route runs.

The caller's Opus track is heard as ``input_audio_buffer.append`` would be (24 kHz PCM in
the session's input format); the ``oai-events`` data channel carries client events in
and server events out, as the socket's frames do. Answer audio goes out on the call's own
track (``webrtc_media.AnswerTrack``) instead of as ``response.output_audio.delta`` events,
and, as OpenAI's WebRTC calls do, ``output_audio_buffer.started``/``stopped``/``cleared``
say when it sounds. Speech that may interrupt (server VAD with ``interrupt_response``) and
a cancelled answer clear the track at once; so does the client's
``output_audio_buffer.clear``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Callable
from typing import Any

import msgspec
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamTrack
from aiortc.rtcdatachannel import RTCDataChannel

from omnistage.api.realtime_resume import LOST, LOST_CODE, SessionSaver
from omnistage.api.webrtc_media import (
    HEARD_RATE,
    SOURCE_RATE,
    AnswerTrack,
    hear,
    hear_promptly,
    ice_configuration,
)
from omnistage.audio.formats import from_pcm16, to_pcm16
from omnistage.protocol.errors import BadRequestError
from omnistage.realtime import events as ev
from omnistage.realtime.config import SessionConfig
from omnistage.realtime.context import SessionContext
from omnistage.realtime.conversation import new_id
from omnistage.realtime.events import MAX_EVENT_BYTES
from omnistage.realtime.session import RealtimeSession

CHANNEL = "oai-events"
CONNECT_TIMEOUT_S = 30.0  # an answered offer whose peer never connects is dropped then
MAX_QUEUED_EVENTS = 4096  # as the WebSocket's: a peer that reads nothing is dropped
_encode = msgspec.json.Encoder().encode


class RealtimeCall:
    """A call from its answered offer until either side hangs up; ``closed`` resolves
    then (the route frees the session slot on it)."""

    def __init__(
        self, ctx: SessionContext, config: SessionConfig, session_id: str | None = None
    ) -> None:
        self.id = new_id("rtc")
        self.pc = RTCPeerConnection(ice_configuration())
        self.track = AnswerTrack(self._sounding)
        self.session = RealtimeSession(ctx, config, self._send, session_id)
        # Where the session is saved (``api.realtime_resume``): its last state is written
        # as the call ends.
        self.saver: SessionSaver | None = None
        self.session.clear_output = self._clear_output
        self.session.playback = self
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._outbox: asyncio.Queue[ev.ServerEvent | None] = asyncio.Queue()
        self._inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        self._channel: RTCDataChannel | None = None
        self._channel_open = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._ending: asyncio.Task[None] | None = None

    async def answer(self, offer_sdp: str, resume: dict[str, Any] | None = None) -> str:
        """Answer the caller's SDP offer; the call then runs on its own. ``resume``:
        ``session.created``'s field where the session is saved."""
        pc = self.pc
        pc.on("datachannel", self._on_channel)
        pc.on("track", self._on_track)
        pc.on("connectionstatechange", self._on_state)
        await pc.setRemoteDescription(RTCSessionDescription(offer_sdp, "offer"))
        for transceiver in pc.getTransceivers():
            if transceiver.kind == "audio":
                hear_promptly(transceiver.receiver)
        pc.addTrack(self.track)
        await pc.setLocalDescription(await pc.createAnswer())
        self._tasks += [
            asyncio.ensure_future(self._write()),
            asyncio.ensure_future(self._read()),
            asyncio.ensure_future(self._connect_deadline()),
        ]
        self.session.opened(resume)
        return str(pc.localDescription.sdp)

    def lost(self) -> None:
        """The session was resumed on another connection: this call ends."""
        self.session.error(BadRequestError(LOST, code=LOST_CODE))
        self.end()

    def end(self) -> None:
        """Close the call from one of its own callbacks or tasks."""
        if self._ending is None:
            self._ending = asyncio.ensure_future(self.close())

    async def close(self) -> None:
        if self.closed.done():
            return
        self.closed.set_result(None)
        self.track.stop()
        await self.session.close()
        if self.saver is not None:
            await self.saver.close()
        self._outbox.put_nowait(None)
        self._inbox.put_nowait(None)
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.pc.close()

    # ------------------------------------------------------------- the peer connection

    def _on_channel(self, channel: RTCDataChannel) -> None:
        if channel.label != CHANNEL or self._channel is not None:
            return
        self._channel = channel
        channel.on("message", self._inbox.put_nowait)
        channel.on("close", self.end)
        if channel.readyState == "open":
            self._channel_open.set()
        channel.on("open", self._channel_open.set)

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self._tasks.append(asyncio.ensure_future(self._listen(track)))

    def _on_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self.end()

    async def _connect_deadline(self) -> None:
        await asyncio.sleep(CONNECT_TIMEOUT_S)
        if self.pc.connectionState != "connected":
            self.end()

    # ------------------------------------------------------------- events both ways

    def _send(self, event: ev.ServerEvent) -> None:
        """The session's events: answer audio to the track, the rest to the channel."""
        if isinstance(event, ev.OutputAudioDelta):
            fmt = self.session.config.output_format
            pcm = to_pcm16(fmt, base64.b64decode(event.delta), SOURCE_RATE)
            self.track.push(event.response_id, event.item_id, pcm)
            return
        if isinstance(event, ev.InputSpeechStarted):
            td = self.session.config.turn_detection
            # A paused track holds an answer all made until the speech is judged (the
            # session resumes or cuts it); anything else playing is cut at once.
            if td is not None and td.interrupt_response and not self.track.paused:
                self._clear_output()
        elif isinstance(event, ev.ResponseDone) and event.response.get("status") == "cancelled":
            self._clear_output()
        if self._outbox.qsize() >= MAX_QUEUED_EVENTS:
            self.end()
            return
        self._outbox.put_nowait(event)

    def _clear_output(self) -> None:
        """Silence the track; an answer cut short keeps only what was played of it, as
        ``conversation.item.truncate`` would (a WebSocket client sends that itself)."""
        cut = self.track.clear()
        if cut is None:
            return
        response, item, played_ms = cut
        self.session.emit(ev.OutputBufferCleared(response_id=response))
        with contextlib.suppress(BadRequestError):  # the item is gone, or has no audio
            self.session.truncate(item, played_ms)

    # ------------------------------------------------------------- the session's playback

    @property
    def sounding(self) -> bool:
        return self.track.sounding

    def pause(self) -> None:
        self.track.pause()

    def resume(self) -> None:
        self.track.resume()

    def cut(self) -> None:
        self._clear_output()

    def _sounding(self, playing: bool, response_id: str) -> None:
        kind = ev.OutputBufferStarted if playing else ev.OutputBufferStopped
        self.session.emit(kind(response_id=response_id))

    async def _write(self) -> None:
        await self._channel_open.wait()
        while (event := await self._outbox.get()) is not None:
            channel = self._channel
            if channel is None or channel.readyState != "open":
                return
            channel.send(_encode(event).decode())

    async def _read(self) -> None:
        while (frame := await self._inbox.get()) is not None:
            if len(frame) > MAX_EVENT_BYTES:
                self.session.error(
                    BadRequestError(
                        f"an event may be at most {MAX_EVENT_BYTES} bytes, got {len(frame)}",
                        code="event_too_large",
                    )
                )
                continue
            await self.session.handle(frame)

    async def _listen(self, track: MediaStreamTrack) -> None:
        append: Callable[[str], None] = self.session.audio.append
        async for pcm in hear(track):
            data = from_pcm16(self.session.config.input_format, pcm, HEARD_RATE)
            try:
                append(base64.b64encode(data).decode())
            except BadRequestError as exc:
                self.session.error(exc)

"""bench_realtime's client over WebRTC (``POST /v1/realtime/calls``) instead of the
WebSocket: the same ``Session`` (microphone frames at real-time pace, the reader of the
server's events) drives a call through ``Call``, which has the two methods of the SDK's
connection that ``Session`` uses.

The microphone's pcm16 frames go up on the call's Opus track, one per frame the session
sends (so the session's clock paces both transports alike); the events come on the
``oai-events`` data channel. Audio deltas are made up for ``Session`` so that it times
both transports alike:

- ``output_audio_buffer.started`` counts as an empty delta as it arrives: the server sends
  it as it puts the answer's first frame on the wire, where the WebSocket would send the
  first delta (first audio);
- each loud 20 ms frame heard on the call's track counts as a delta of the response
  sounding then: the first is when the caller hears the answer begin, the last of an
  answer spoken over is what it still heard of it (barge-in). The caller's jitter buffer
  is as small as aiortc allows a player: it releases a frame when the next one arrives
  (``prefetch=1``, one 20 ms frame held; aiortc's own holds four, 80 ms; the server,
  which only listens, holds none: ``webrtc_media.hear_promptly``);
- each such delta also says when the server sent that frame (``sent_at``), from its RTP
  timestamp: the track's frames are paced by the server's clock, so a frame's send time
  is its timestamp plus one offset, the least (arrival - timestamp) seen on the call's
  frames (silence flows between answers), less the frame the jitter buffer holds;
- and when a player hears it (``heard_at``): as the packet after it arrives (which
  releases it from the one-frame buffer), plus where in the frame the sound starts (as
  the WebSocket's first delta counts from its first loud sample). aiortc decodes on a
  thread of this process, which on a loaded machine hands frames over late, bunched;
  when it did is ``decoded_at``, printed apart: a browser decodes on a real-time thread.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fractions
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import av
import httpx
import numpy as np
from aiortc import RTCPeerConnection, RTCRtpReceiver, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtp import RtpPacket

from omnistage.api.webrtc_media import (
    HOSTS_ENV,
    hear_promptly,
    ice_configuration,
    restrict_host_addresses,
)
from omnistage.audio.resample import StreamResampler

RATE = 24000  # the session's pcm16, as the WebSocket client sends it
TRACK_RATE = 48000
FRAME_SAMPLES = TRACK_RATE // 50
LOUD = 300  # |sample| past this in a decoded frame: the answer sounding, not Opus silence
FRAME_S = 0.02


def loopback() -> None:
    """Calls stay on this machine: the server (started after this) and this client both
    offer only 127.0.0.1."""
    os.environ.setdefault(HOSTS_ENV, "127.0.0.1")
    restrict_host_addresses()


class _Microphone(MediaStreamTrack):
    """Sends the frames it is given, as they are given (the session paces them), at
    48 kHz as a browser's microphone does: aiortc's Opus encoder would otherwise resample
    them itself, and its fixed-size output frames would hold each one 20 ms."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self.frames: asyncio.Queue[np.ndarray] = asyncio.Queue()
        self._pts = 0
        self._up = StreamResampler(RATE, TRACK_RATE)
        # The resampler holds back its look-ahead: silence before the first frame keeps
        # every frame whole (0.4 ms late) instead of each one a frame late.
        self._first = True

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        said = await self.frames.get()
        pcm = self._up.push(said)
        if self._first:
            pad = np.zeros(len(said) * TRACK_RATE // RATE - len(pcm), np.int16)
            pcm, self._first = np.concatenate([pad, pcm]), False
        frame = av.AudioFrame(format="s16", layout="mono", samples=len(pcm))
        frame.planes[0].update(pcm.astype("<i2").tobytes())
        frame.sample_rate, frame.time_base = TRACK_RATE, fractions.Fraction(1, TRACK_RATE)
        frame.pts = self._pts
        self._pts += len(pcm)
        return frame


class Call:
    """A call with ``send_raw`` and ``recv_bytes``, as ``bench_realtime.Session`` uses
    the SDK's connection."""

    def __init__(self) -> None:
        self.pc = RTCPeerConnection(ice_configuration())
        self.mic = _Microphone()
        self.pc.addTrack(self.mic)
        self.channel = self.pc.createDataChannel("oai-events")
        self.inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.channel.on("message", self._message)
        self.opened = asyncio.Event()
        self.channel.on("open", self.opened.set)
        self.sounding: str | None = None  # the response whose audio the track plays
        self._offset = float("inf")  # least (arrival - RTP time) so far: the server's clock
        self._origin: int | None = None  # the first RTP timestamp: decoded frames count from it
        self._arrived: dict[int, float] = {}  # a packet's arrival, by its frame's pts
        self._tasks: list[asyncio.Task[Any]] = []
        self.pc.on("track", lambda t: self._tasks.append(asyncio.ensure_future(self._hear(t))))

    def _message(self, message: str | bytes) -> None:
        raw = message.encode() if isinstance(message, str) else message
        self.inbox.put_nowait(raw)
        if b'"output_audio_buffer.started"' in raw:
            self.sounding = json.loads(raw)["response_id"]
            self._delta(self.sounding, 0, None)

    async def send_raw(self, event: str) -> None:
        parsed = json.loads(event)
        if parsed.get("type") == "input_audio_buffer.append":
            self.mic.frames.put_nowait(np.frombuffer(base64.b64decode(parsed["audio"]), "<i2"))
        elif self.channel.readyState == "open":
            self.channel.send(event)

    async def recv_bytes(self) -> bytes:
        return await self.inbox.get()

    def time_packets(self, receiver: RTCRtpReceiver) -> None:
        """Note when each of ``receiver``'s RTP packets arrives, on this event loop, before
        the decoder thread has it."""
        handle = receiver._handle_rtp_packet

        async def timed(packet: RtpPacket, arrival_time_ms: int) -> None:
            if self._origin is None:
                self._origin = packet.timestamp
            self._arrived[(packet.timestamp - self._origin) % 2**32] = time.monotonic()
            await handle(packet, arrival_time_ms)

        receiver._handle_rtp_packet = timed  # type: ignore[method-assign]

    async def _hear(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            now, pts = time.monotonic(), int(frame.pts or 0)
            rtp_s = pts / TRACK_RATE
            self._offset = min(self._offset, now - rtp_s)
            arrived = self._arrived.get(pts, now)
            released = self._arrived.get(pts + FRAME_SAMPLES, now)
            for old in [p for p in self._arrived if p < pts]:
                del self._arrived[old]
            pcm = frame.to_ndarray().reshape(-1)
            loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > LOUD)
            if self.sounding and len(loud):
                into = loud[0] // len(frame.layout.channels) / TRACK_RATE
                sent = rtp_s + self._offset - FRAME_S
                self._delta(self.sounding, FRAME_S, sent, (arrived, released + into, now + into))

    def _delta(
        self,
        response_id: str,
        seconds: float,
        sent_at: float | None,
        heard: tuple[float, float, float] | None = None,
    ) -> None:
        """As the WebSocket's delta of ``seconds`` of audio: (len * 3/4) / 2 / RATE s;
        ``sent_at``: when the server sent it (None: not a frame); ``heard``: when its
        packet arrived, when a player hears it, and when this process decoded it."""
        size = int(seconds * RATE * 2 * 4 / 3)
        delta: dict[str, Any] = {"type": "response.output_audio.delta", "response_id": response_id}
        if sent_at is not None:
            delta["sent_at"] = sent_at
        if heard is not None:
            delta["arrived_at"], delta["heard_at"], delta["decoded_at"] = heard
        self.inbox.put_nowait(json.dumps({**delta, "delta": "A" * size}).encode())

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await self.pc.close()


@contextlib.asynccontextmanager
async def connect(base_url: str, model: str, session: dict[str, Any]) -> AsyncIterator[Call]:
    """A call to ``base_url`` with ``session`` as its config, its channel open."""
    call = Call()
    try:
        await call.pc.setLocalDescription(await call.pc.createOffer())
        form = {
            "sdp": (None, call.pc.localDescription.sdp),
            "session": (None, json.dumps({**session, "model": model})),
        }
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            r = await http.post("/v1/realtime/calls", files=form)
        r.raise_for_status()
        await call.pc.setRemoteDescription(RTCSessionDescription(r.text, "answer"))
        for transceiver in call.pc.getTransceivers():
            hear_promptly(transceiver.receiver, hold=1)
            call.time_packets(transceiver.receiver)
        await asyncio.wait_for(call.opened.wait(), 30)
        yield call
    finally:
        await call.close()

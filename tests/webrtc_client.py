"""A Python WebRTC caller for POST /v1/realtime/calls, on aiortc, as a browser would call:
an Opus microphone track, the ``oai-events`` data channel, the answer's audio heard on the
call's incoming track.

``Caller.speak`` queues 24 kHz pcm16 for the microphone, which sends it paced in real time
(silence otherwise); ``events`` gets the server's events as dicts; ``loud`` holds when
each loud frame of the answer arrived (``time.monotonic``), and ``loud_pts`` its RTP
timestamp (the server's clock: the caller's own receive path may bunch frames). ICE
stays on loopback (``OMNISTAGE_WEBRTC_HOSTS``, which tests/conftest.py sets for the
heads too).
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import json
import os
import time
from typing import Any

import av
import httpx
import numpy as np
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from omnistage.api.webrtc_media import HOSTS_ENV, ice_configuration, restrict_host_addresses
from omnistage.audio.resample import resample

RATE = 48000
FRAME = RATE // 50
LOUD = 300  # a decoded frame with a sample past this is answer audio, not Opus silence


class Microphone(MediaStreamTrack):
    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._pending = np.zeros(0, np.int16)
        self._start: float | None = None
        self._pts = 0
        self.drained = asyncio.Event()

    def say(self, pcm24k: np.ndarray) -> None:
        self._pending = np.concatenate([self._pending, resample(pcm24k, 24000, RATE)])
        self.drained.clear()

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        self._start = self._start or now
        wait = self._start + self._pts / RATE - now
        if wait > 0:
            await asyncio.sleep(wait)
        chunk, self._pending = self._pending[:FRAME], self._pending[FRAME:]
        if not len(self._pending):
            self.drained.set()
        chunk = np.concatenate([chunk, np.zeros(FRAME - len(chunk), np.int16)])
        frame = av.AudioFrame(format="s16", layout="mono", samples=FRAME)
        frame.planes[0].update(chunk.tobytes())
        frame.sample_rate, frame.time_base, frame.pts = RATE, fractions.Fraction(1, RATE), self._pts
        self._pts += FRAME
        return frame


class Caller:
    def __init__(self) -> None:
        os.environ.setdefault(HOSTS_ENV, "127.0.0.1")
        restrict_host_addresses()
        self.pc = RTCPeerConnection(ice_configuration())
        self.mic = Microphone()
        self.pc.addTrack(self.mic)
        self.channel = self.pc.createDataChannel("oai-events")
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.log: list[tuple[float, dict[str, Any]]] = []  # every event, with its arrival
        self.loud: list[float] = []
        self.loud_pts: list[int] = []  # their RTP timestamps: the server's clock, 48 kHz
        self.heard_samples = 0
        self.location = ""
        self.answer_sdp = ""  # the server's SDP answer
        self._tasks: list[asyncio.Task[Any]] = []
        self.channel.on("message", self._event)
        self.pc.on("track", lambda t: self._tasks.append(asyncio.ensure_future(self._hear(t))))

    async def call(
        self,
        base_url: str,
        token: str | None = None,
        session: dict[str, Any] | None = None,
        query: str = "",
    ) -> httpx.Response:
        """Offer the call (``query``: the URL's, e.g. a resume's); on a 201, the answer
        is applied and the call connects."""
        await self.pc.setLocalDescription(await self.pc.createOffer())
        offer = self.pc.localDescription.sdp
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            if session is None:
                headers["Content-Type"] = "application/sdp"
                r = await http.post(f"/v1/realtime/calls{query}", content=offer, headers=headers)
            else:
                form = {"sdp": offer, "session": json.dumps(session)}
                path = f"/v1/realtime/calls{query}"
                r = await http.post(path, files=_fields(form), headers=headers)
        if r.status_code == 201:
            self.location, self.answer_sdp = r.headers["location"], r.text
            await self.pc.setRemoteDescription(RTCSessionDescription(r.text, "answer"))
        return r

    async def next(self, kind: str, timeout: float) -> dict[str, Any]:
        """The next event of type ``kind`` (others are skipped); an error event fails."""
        async with asyncio.timeout(timeout):
            while True:
                event = await self.events.get()
                if event["type"] == kind:
                    return event
                assert event["type"] != "error", event

    def _event(self, message: str) -> None:
        event = json.loads(message)
        self.log.append((time.monotonic(), event))
        self.events.put_nowait(event)

    async def seen(self, kind: str, timeout: float) -> dict[str, Any]:
        """The first event of type ``kind`` so far, or the first to come (``next`` would
        skip one that came before the event it last returned)."""
        async with asyncio.timeout(timeout):
            while True:
                found = [e for _, e in self.log if e["type"] == kind]
                if found:
                    return found[0]
                await asyncio.sleep(0.02)

    def arrived(self, kind: str, **fields: Any) -> float:
        """When the first event of type ``kind`` (with ``fields``) arrived."""
        return next(
            t
            for t, e in self.log
            if e["type"] == kind and all(e.get(k) == v for k, v in fields.items())
        )

    def send(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    async def _hear(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            pcm = frame.to_ndarray()
            self.heard_samples += frame.samples
            if np.abs(pcm.astype(np.int32)).max() > LOUD:
                self.loud.append(time.monotonic())
                self.loud_pts.append(int(frame.pts or 0))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await self.pc.close()


def _fields(form: dict[str, str]) -> dict[str, tuple[None, str]]:
    """Plain multipart fields (no file name), as a browser's FormData of strings."""
    return {k: (None, v) for k, v in form.items()}

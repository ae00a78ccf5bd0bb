"""The media side of a Realtime call over WebRTC (``api.webrtc_call``), on aiortc.

``AnswerTrack`` is the call's outgoing audio: the answers' PCM (24 kHz, as the session's
pcm output format has it), resampled to 48 kHz one 20 ms frame at a time as it is sent,
paced by the clock (silence between answers, as a microphone's track would be), which
``clear`` empties at once on a barge-in. Resampling per frame, not per answer sentence as
it arrives, keeps a sentence's few seconds of filtering off the event loop at the moment
its first frame is due. An answer that starts after silence does not wait for the next
20 ms tick: its first frame goes as it is pushed, and the clock counts on from there.
``hear`` reads the caller's track: Opus decoded by aiortc, each frame resampled to 24 kHz
mono PCM.

The ICE settings, from the environment of the API server: ``restrict_host_addresses``:
aioice offers a host candidate on every interface but loopback; ``OMNISTAGE_WEBRTC_HOSTS``
(comma-separated IPs) replaces that list, e.g. ``127.0.0.1`` for calls that must stay on
the machine (the tests), or the one address clients can reach on a host with many.
``ice_configuration``: no STUN server unless ``OMNISTAGE_WEBRTC_STUN`` names some (aiortc
would ask Google's), since a server's own addresses are usually what its clients reach.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections.abc import AsyncIterator, Callable

import aioice.ice
import av
import numpy as np
from aiortc import RTCConfiguration, RTCIceServer, RTCRtpReceiver
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtp import RtpPacket
from aiortc.utils import uint16_add

from omnistage import envs
from omnistage.audio.resample import StreamResampler

RATE = 48000  # Opus's clock: the track's frames are at this rate
FRAME_SAMPLES = RATE // 50  # 20 ms
HEARD_RATE = 24000  # the caller's audio, as the session's pcm input format has it
SOURCE_RATE = 24000  # the answers' audio as ``AnswerTrack.push`` takes it
_SOURCE_FRAME = SOURCE_RATE // 50
HOSTS_ENV = "OMNISTAGE_WEBRTC_HOSTS"
_TIME_BASE = fractions.Fraction(1, RATE)


def restrict_host_addresses() -> tuple[str, ...] | None:
    """Offer only the addresses ``OMNISTAGE_WEBRTC_HOSTS`` names as host candidates, if
    set (read once per process, before the first call gathers); the addresses used."""
    hosts = envs.webrtc_hosts()
    if hosts:
        aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: [
            h for h in hosts if (":" in h and use_ipv6) or (":" not in h and use_ipv4)
        ]
    return hosts or None


def ice_configuration() -> RTCConfiguration:
    """The STUN servers ``OMNISTAGE_WEBRTC_STUN`` names (``stun:host:port``, comma-separated);
    none by default."""
    return RTCConfiguration(iceServers=[RTCIceServer(u) for u in envs.webrtc_stun()])


class AnswerTrack(MediaStreamTrack):
    """The answers' audio, played out in real time; ``on_change(playing, response_id)``
    is called as an answer starts and stops sounding."""

    kind = "audio"

    def __init__(self, on_change: Callable[[bool, str], None]) -> None:
        super().__init__()
        self._on_change = on_change
        self._pending = np.zeros(0, np.int16)  # at SOURCE_RATE, not yet resampled
        self._ready = np.zeros(0, np.int16)  # at RATE, resampled, not yet sent
        self._up = StreamResampler(SOURCE_RATE, RATE)
        self._response: str | None = None  # whose audio is pending or playing
        self._item: str | None = None  # the answer item it is of
        self._played = 0  # samples (at RATE) of that item played
        self._playing = False
        self._paused = False  # held: silence goes out, what is queued stays
        self._start: float | None = None
        self._pts = 0
        self._tick: asyncio.Future[None] | None = None  # ``recv`` waits on it for its time

    def push(self, response_id: str, item_id: str, pcm: np.ndarray) -> None:
        """Queue ``pcm`` (int16 at ``SOURCE_RATE``) of ``response_id``'s answer to be played."""
        if item_id != self._item:
            self._item, self._played = item_id, -self._queued()
        self._response = response_id
        silent = not self._playing and self._queued() == 0
        self._pending = np.concatenate([self._pending, pcm])
        if silent and self._tick is not None:
            _wake(self._tick)  # the silence frame due next waits no longer

    def _queued(self) -> int:
        """Samples (at RATE) queued and not yet sent."""
        return len(self._ready) + len(self._pending) * RATE // SOURCE_RATE

    @property
    def sounding(self) -> bool:
        """An answer's audio is playing, or queued to play."""
        return self._playing or self._queued() > 0

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Hold the answer where it is: silence goes out until ``resume`` (or ``clear``)."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        if self._queued() and self._tick is not None:
            _wake(self._tick)

    def clear(self) -> tuple[str, str, int] | None:
        """Drop what is left to play; if an answer was sounding, its response, its item
        and how many ms of that item were played."""
        had = self.sounding
        self._pending = self._ready = np.zeros(0, np.int16)
        self._up = StreamResampler(SOURCE_RATE, RATE)
        self._playing = self._paused = False
        if not had or self._response is None or self._item is None:
            return None
        return self._response, self._item, max(0, self._played) * 1000 // RATE

    @property
    def pending_s(self) -> float:
        return self._queued() / RATE

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._start is None:
            self._start = now
        wait = self._start + self._pts / RATE - now
        if wait > 0 and not self._playing and self._queued():
            self._start -= wait  # an answer starts: its first frame goes now
        elif wait > 0:
            await self._until(wait)
        elif wait < -0.1:  # fell behind (a stalled loop): skip ahead, do not burst
            self._pts = int((now - self._start) * RATE)
        frame = av.AudioFrame(format="s16", layout="mono", samples=FRAME_SAMPLES)
        frame.planes[0].update(self._take().tobytes())
        frame.sample_rate = RATE
        frame.time_base = _TIME_BASE
        frame.pts = self._pts
        self._pts += FRAME_SAMPLES
        return frame

    async def _until(self, wait: float) -> None:
        """Sleep ``wait`` s, or less if an answer is pushed meanwhile: then its frame goes
        now, and the clock is set back so that the frames after it keep 20 ms apart (the
        RTP timestamps stay contiguous: the silence before was filler)."""
        loop = asyncio.get_running_loop()
        self._tick = tick = loop.create_future()
        timer = loop.call_later(wait, _wake, tick)
        try:
            await tick
        finally:
            timer.cancel()
            self._tick = None
        early = self._start + self._pts / RATE - time.monotonic()  # type: ignore[operator]
        if early > 0:
            self._start -= early  # type: ignore[operator]

    def _take(self) -> np.ndarray:
        if self._paused:
            return np.zeros(FRAME_SAMPLES, np.int16)
        # The resampler holds back a few samples of look-ahead: pull until a frame is
        # full, and flush it when the answer's audio runs out.
        while len(self._ready) < FRAME_SAMPLES and len(self._pending):
            source, self._pending = self._pending[:_SOURCE_FRAME], self._pending[_SOURCE_FRAME:]
            parts = [self._ready, self._up.push(source)]
            if not len(self._pending):
                parts.append(self._up.flush())
            self._ready = np.concatenate(parts)
        chunk, self._ready = self._ready[:FRAME_SAMPLES], self._ready[FRAME_SAMPLES:]
        self._played += len(chunk)
        if len(chunk) and not self._playing and self._response is not None:
            self._playing = True
            self._on_change(True, self._response)
        elif not len(chunk) and self._playing and self._response is not None:
            self._playing = False
            self._on_change(False, self._response)
        if len(chunk) < FRAME_SAMPLES:
            chunk = np.concatenate([chunk, np.zeros(FRAME_SAMPLES - len(chunk), np.int16)])
        return chunk


def _wake(tick: asyncio.Future[None]) -> None:
    if not tick.done():
        tick.set_result(None)


class PromptJitterBuffer(JitterBuffer):
    """Each audio packet is a frame (Opus's are), passed on as it arrives; one that
    comes after a later one (or twice) is dropped. aiortc's buffer releases a frame only
    when the next one arrives, 20 ms later at the least."""

    def __init__(self) -> None:
        super().__init__(capacity=16)
        self._last: int | None = None

    def add(self, packet: RtpPacket) -> tuple[bool, JitterFrame | None]:
        last = self._last
        if last is not None and not 0 < uint16_add(packet.sequence_number, -last) < 0x8000:
            return False, None
        self._last = packet.sequence_number
        return False, JitterFrame(packet._data, packet.timestamp)  # type: ignore[attr-defined]


def hear_promptly(receiver: RTCRtpReceiver, hold: int = 0) -> None:
    """Pass the caller's audio on as it arrives (``hold`` 0: ``PromptJitterBuffer``), or
    after ``hold`` frames, not aiortc's four: the server does not play it, it listens (VAD,
    the listener), and each 20 ms less in that buffer is 20 ms earlier at the end of every
    turn. A caller that plays what it hears holds a frame at least (``hold`` 1: aiortc's
    least). aiortc has no setting for it; without the attribute (another aiortc), its own
    buffer stays."""
    attr = "_RTCRtpReceiver__jitter_buffer"
    if hasattr(receiver, attr):
        buffer = PromptJitterBuffer() if hold == 0 else JitterBuffer(16, prefetch=hold)
        setattr(receiver, attr, buffer)


async def hear(track: MediaStreamTrack) -> AsyncIterator[np.ndarray]:
    """The caller's audio as int16 mono PCM at ``HEARD_RATE``, one piece per frame."""
    resampler = av.AudioResampler(format="s16", layout="mono", rate=HEARD_RATE)
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        for out in resampler.resample(frame):
            yield out.to_ndarray().reshape(-1).astype(np.int16, copy=False)

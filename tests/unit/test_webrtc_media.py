"""The call's outgoing track (``api.webrtc_media.AnswerTrack``): answers' audio (24 kHz)
in 20 ms frames at 48 kHz, silence between them, started/stopped as an answer sounds, and a clear
that drops the rest and says how much of the item was played; an answer after silence
goes at once. The server's receive buffer passes each packet on as it comes."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from aiortc.rtp import RtpPacket

from omnistage.api.webrtc_media import (
    FRAME_SAMPLES,
    RATE,
    SOURCE_RATE,
    AnswerTrack,
    PromptJitterBuffer,
)

EDGE = 40


def _track() -> tuple[AnswerTrack, list[tuple[bool, str]]]:
    changes: list[tuple[bool, str]] = []
    return AnswerTrack(lambda playing, rid: changes.append((playing, rid))), changes


async def test_an_answer_plays_in_paced_frames_then_silence() -> None:
    track, changes = _track()
    track.push("resp_1", "item_1", np.full(SOURCE_RATE * 3 // 100, 1000, np.int16))  # 30 ms
    t0 = time.monotonic()
    frames = [await track.recv() for _ in range(4)]
    assert time.monotonic() - t0 >= 0.055  # the 2nd to 4th frames wait for their time
    pcm = [f.to_ndarray().reshape(-1) for f in frames]
    assert all(f.sample_rate == RATE and f.samples == FRAME_SAMPLES for f in frames)
    assert [f.pts for f in frames] == [0, FRAME_SAMPLES, 2 * FRAME_SAMPLES, 3 * FRAME_SAMPLES]
    # Resampled to 48 kHz as it is sent: the level holds, past the filter's edges
    # (EDGE samples of ringing where the sound starts and stops).
    half = FRAME_SAMPLES // 2
    assert (abs(pcm[0][EDGE:] - 1000) < 20).all() and (abs(pcm[1][: half - EDGE] - 1000) < 20).all()
    assert not pcm[1][half + EDGE :].any() and not pcm[2].any()
    assert changes == [(True, "resp_1"), (False, "resp_1")]


async def test_a_clear_drops_the_rest_and_says_what_was_played() -> None:
    track, changes = _track()
    track.push("resp_1", "item_1", np.full(SOURCE_RATE, 1000, np.int16))  # 1 s
    await track.recv()
    await track.recv()
    assert track.clear() == ("resp_1", "item_1", 40)
    assert not (await track.recv()).to_ndarray().any()
    assert track.clear() is None  # nothing was sounding
    assert changes == [(True, "resp_1")]  # a clear is the caller's to report


async def test_an_answer_after_silence_goes_at_once_then_in_paced_frames() -> None:
    track, changes = _track()
    await track.recv()  # silence: the track's clock runs
    waiting = asyncio.ensure_future(track.recv())  # the next silence frame waits its 20 ms
    await asyncio.sleep(0.002)
    t0 = time.monotonic()
    track.push("resp_1", "item_1", np.full(SOURCE_RATE // 10, 1000, np.int16))  # 100 ms
    first = await waiting
    assert time.monotonic() - t0 < 0.010, "the answer's first frame waited for the tick"
    assert (abs(first.to_ndarray().reshape(-1)[EDGE:] - 1000) < 20).all()
    t1 = time.monotonic()
    second = await track.recv()
    assert time.monotonic() - t1 >= 0.015  # then paced from it: no burst after
    assert [first.pts, second.pts] == [FRAME_SAMPLES, 2 * FRAME_SAMPLES]  # contiguous
    assert changes == [(True, "resp_1")]


def _packet(seq: int) -> RtpPacket:
    packet = RtpPacket(sequence_number=seq % 65536, timestamp=seq * FRAME_SAMPLES)
    packet._data = bytes([seq % 256])  # type: ignore[attr-defined]  # as aiortc depayloads
    return packet


def test_the_servers_receive_buffer_passes_each_packet_on_as_it_comes() -> None:
    buffer = PromptJitterBuffer()
    got = [buffer.add(_packet(seq))[1] for seq in (65534, 65535, 0, 2, 1, 2, 3)]
    # In order across the wrap and past a lost packet; late and repeated ones dropped.
    kept = [f.timestamp // FRAME_SAMPLES if f else None for f in got]
    assert kept == [65534, 65535, 0, 2, None, None, 3]
    assert got[3] is not None and got[3].data == bytes([2])

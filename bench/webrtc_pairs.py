"""bench_realtime --webrtc: the per-question figures of a WebSocket session and a WebRTC
call asked the same questions in turn (``bench_realtime.paired_script``: question ``i``
goes first over the WebSocket when ``i`` is even, over WebRTC when it is odd).

A question's time to first audio heard is split where both transports show it:

- ``in``: end of speech -> ``speech_stopped`` (the caller's audio reaching the server's
  VAD: the transport's way in, plus the same 500 ms of silence);
- ``server``: ``speech_stopped`` -> first audio sent (the WebSocket's first delta;
  WebRTC's ``output_audio_buffer.started``, sent with the first frame): transcription,
  thinker and talker, the same work on both (greedy answers to the same question), and
  the call's track putting the first frame on the wire;
- ``out``: first audio sent -> heard (the WebSocket: its first loud sample; WebRTC: the
  first loud frame out of a player's one-frame jitter buffer).

Each difference (WebRTC - WebSocket) is taken per question, and its median over the
questions the WebSocket asked first is averaged with that over those WebRTC asked first:
what going second does (a warm prefix cache, a talker already loaded) counts for both.
"""

from __future__ import annotations

import statistics
from typing import Any, Protocol


class _Turn(Protocol):
    end_of_speech: float | None
    speech_stopped: float | None
    deltas: list[tuple[float, float]]
    decoded_at: float | None
    transcript: str

    @property
    def first_heard_s(self) -> float | None: ...


PARTS = ("in", "server", "out", "heard")


def parts(turn: _Turn) -> dict[str, float] | None:
    """A question's time to first audio heard, split (None: unanswered, or unheard)."""
    heard, eos, stopped = turn.first_heard_s, turn.end_of_speech, turn.speech_stopped
    if heard is None or eos is None or stopped is None or not turn.deltas:
        return None
    sent = turn.deltas[0][0] - eos
    return {"in": stopped - eos, "server": sent - (stopped - eos), "out": heard - sent} | {
        "heard": heard
    }


def balanced_median(diffs: list[tuple[bool, float]]) -> float | None:
    """The mean of the medians of ``diffs`` (``(websocket_first, diff)``) by order."""
    medians = [
        statistics.median(xs)
        for first in (True, False)
        if (xs := [d for f, d in diffs if f == first])
    ]
    return sum(medians) / len(medians) if medians else None


def paired_figures(ws: list[_Turn], rtc: list[_Turn]) -> dict[str, Any]:
    """WebRTC - WebSocket per question, each part; the same answer's count; what this
    process's decoder thread added over a player's hearing."""
    diffs: dict[str, list[tuple[bool, float]]] = {k: [] for k in PARTS}
    same = 0
    for i, (w, r) in enumerate(zip(ws, rtc, strict=False)):
        pw, pr = parts(w), parts(r)
        if pw is None or pr is None:
            continue
        same += w.transcript.strip() == r.transcript.strip()
        for k in PARTS:
            diffs[k].append((i % 2 == 0, pr[k] - pw[k]))
    decoder = [
        t.decoded_at - t.deltas[1][0] for t in rtc if t.decoded_at is not None and len(t.deltas) > 1
    ]
    return {
        "pairs": len(diffs["heard"]),
        "same_answer": same,
        "median_diff_s": {k: balanced_median(v) for k, v in diffs.items()},
        "heard_diff_s": [round(d, 3) for _, d in diffs["heard"]],
        "decoder_late_p50_s": statistics.median(decoder) if decoder else None,
        "decoder_late_max_s": max(decoder) if decoder else None,
    }

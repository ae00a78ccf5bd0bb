"""An answer's audio held while the user may be interrupting it, and sent again past a
client's truncate (``output_hold.AudioHold``)."""

from __future__ import annotations

from omnistage.realtime.events import OutputAudioDelta, ServerEvent
from omnistage.realtime.output_hold import AudioHold


def _delta(data: bytes) -> OutputAudioDelta:
    return OutputAudioDelta(response_id="r", item_id="i", output_index=0, delta=data.hex())


def _sent(events: list[ServerEvent]) -> bytes:
    return b"".join(bytes.fromhex(e.delta) for e in events if isinstance(e, OutputAudioDelta))


def test_held_audio_goes_out_in_order_on_release_and_never_after_a_drop() -> None:
    out: list[ServerEvent] = []
    hold = AudioHold(out.append)
    hold.audio(_delta(b"ab"), 10, b"ab")
    hold.hold()
    hold.audio(_delta(b"cd"), 10, b"cd")
    assert _sent(out) == b"ab" and hold.sent_ms == 10
    hold.release()
    assert _sent(out) == b"abcd" and hold.sent_ms == 20
    hold.hold()
    hold.audio(_delta(b"ef"), 10, b"ef")
    hold.drop()
    hold.audio(_delta(b"gh"), 10, b"gh")
    assert _sent(out) == b"abcdgh"


def test_a_rewind_while_held_sends_what_the_client_dropped_before_the_held_audio() -> None:
    out: list[ServerEvent] = []
    hold = AudioHold(out.append)
    hold.audio(_delta(b"abcd"), 40, b"abcd")
    hold.audio(_delta(b"efgh"), 40, b"efgh")
    hold.hold()
    hold.audio(_delta(b"ijkl"), 40, b"ijkl")
    hold.rewind(3, _delta)  # the client kept "abc": "defgh" was never heard
    assert _sent(out) == b"abcdefgh" and hold.sent_ms == 30
    hold.release()
    # What the client has: what it kept, then everything after the truncate.
    after = _sent(out[2:])
    assert b"abc" + after == b"abcdefghijkl"
    assert hold.sent_ms == 120


def test_a_rewind_of_flowing_audio_sends_the_rest_again_at_once() -> None:
    out: list[ServerEvent] = []
    hold = AudioHold(out.append)
    hold.audio(_delta(b"abcd"), 40, b"abcd")
    hold.rewind(4, _delta)  # all of it heard: nothing to send again
    assert len(out) == 1
    hold.rewind(1, _delta)
    assert _sent(out[1:]) == b"bcd" and hold.sent_ms == 40

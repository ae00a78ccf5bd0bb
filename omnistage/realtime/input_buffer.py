"""The session's input audio buffer: 24 kHz pcm16 with its place on the session's audio
clock (ms since the first append), so VAD times map to bytes."""

from __future__ import annotations

RATE = 24_000
BYTES_PER_MS = RATE * 2 / 1000


class InputBuffer:
    def __init__(self) -> None:
        self._pcm = bytearray()
        self.start_ms = 0.0  # session audio time of the first byte held

    @property
    def end_ms(self) -> float:
        return self.start_ms + len(self._pcm) / BYTES_PER_MS

    def __len__(self) -> int:
        return len(self._pcm)

    def append(self, pcm: bytes) -> None:
        self._pcm += pcm

    def _at(self, ms: float) -> int:
        return max(0, min(len(self._pcm), int((ms - self.start_ms) * BYTES_PER_MS))) & ~1

    def slice(self, start_ms: float, end_ms: float | None = None) -> bytes:
        a = self._at(start_ms)
        b = len(self._pcm) if end_ms is None else max(a, self._at(end_ms))
        return bytes(self._pcm[a:b])

    def drop_before(self, ms: float) -> None:
        """Forget the audio before ``ms`` (committed, or too old to matter)."""
        cut = self._at(ms)
        del self._pcm[:cut]
        self.start_ms += cut / BYTES_PER_MS

    def keep_last(self, ms: float) -> None:
        self.drop_before(self.end_ms - ms)

    def clear(self) -> None:
        self.drop_before(self.end_ms)

"""The echo engine's tensors: payloads a test can check end to end.

Tensor ``index`` of a request holds its index (8 bytes, little-endian), the sender's
``time.monotonic_ns()`` when it was made (8 bytes: CLOCK_MONOTONIC is one clock for every
process of a host, so a receiver on the same host can time the transit), then a pattern
that depends on the index. A receiving stage (``check_tensors``) checks the order, adds
the bytes to a CRC-32 of everything but the send times, and times each transit; its
``summary`` ends the stage's output, where a test compares it with ``expected``.
"""

from __future__ import annotations

import functools
import re
import statistics
import time
import zlib

from omnistage.engines.base import EngineChunk
from omnistage.protocol.chunk_meta import TensorMeta
from omnistage.protocol.enums import Modality

_BASE = bytes(range(256))
_SUMMARY = re.compile(
    r"\[tensors n=(\d+) bytes=(\d+) crc=([0-9a-f]{8}) ordered=(yes|no) "
    r"transit_us_p50=(\d+) transit_us_mean=(\d+)\]"
)


def payload(index: int, nbytes: int, sent_ns: int = 0) -> bytes:
    """Tensor ``index`` of ``nbytes`` (>= 16) bytes, sent at ``sent_ns``: after the header,
    the bytes 0..255 repeated, starting at ``index % 256``. One copy, so that making a
    large tensor does not cost more than moving it."""
    body_len = nbytes - 16
    shift = index % 256
    body = memoryview(_periodic(body_len))[shift : shift + body_len]
    return b"".join((index.to_bytes(8, "little"), sent_ns.to_bytes(8, "little"), body))


@functools.lru_cache(maxsize=4)
def _periodic(body_len: int) -> bytes:
    return _BASE * (body_len // 256 + 2)


def tensor_chunk(modality: Modality, index: int, nbytes: int) -> EngineChunk:
    data = payload(index, nbytes, time.monotonic_ns())
    return EngineChunk(modality, data=data, meta=TensorMeta("hidden_states", "uint8", (nbytes,)))


class TensorTally:
    """What one request's receiving stage found in the tensors it read."""

    def __init__(self) -> None:
        self.count = 0
        self.nbytes = 0
        self.crc = 0
        self.ordered = True
        self.transit_ns: list[int] = []

    def add(self, data: bytes) -> None:
        now = time.monotonic_ns()
        if int.from_bytes(data[:8], "little") != self.count:
            self.ordered = False
        self.transit_ns.append(now - int.from_bytes(data[8:16], "little"))
        view = memoryview(data)
        self.crc = zlib.crc32(view[16:], zlib.crc32(view[:8], self.crc))
        self.count += 1
        self.nbytes += len(data)

    def summary(self) -> str:
        p50 = statistics.median(self.transit_ns) if self.transit_ns else 0
        mean = statistics.fmean(self.transit_ns) if self.transit_ns else 0
        return (
            f" [tensors n={self.count} bytes={self.nbytes} crc={self.crc:08x} "
            f"ordered={'yes' if self.ordered else 'no'} "
            f"transit_us_p50={int(p50 // 1000)} transit_us_mean={int(mean // 1000)}]"
        )


def expected(count: int, nbytes: int) -> tuple[int, int, str]:
    """(n, bytes, crc) a receiver reports for ``count`` intact tensors of ``nbytes``."""
    crc = 0
    for index in range(count):
        data = payload(index, nbytes)
        crc = zlib.crc32(data[16:], zlib.crc32(data[:8], crc))
    return count, count * nbytes, f"{crc:08x}"


def parse(text: str) -> dict[str, int | str] | None:
    """The tally a receiving stage wrote at the end of ``text``; None if none."""
    found = _SUMMARY.search(text)
    if found is None:
        return None
    n, nbytes, crc, ordered, p50, mean = found.groups()
    return {
        "n": int(n),
        "bytes": int(nbytes),
        "crc": crc,
        "ordered": ordered,
        "transit_us_p50": int(p50),
        "transit_us_mean": int(mean),
    }

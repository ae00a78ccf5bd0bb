"""G.711 companding (ITU-T G.711): mu-law and A-law, 8-bit codes <-> 16-bit linear PCM.

The Realtime API's telephony formats (``audio/pcmu``, ``audio/pcma``) carry one G.711 byte
per 8 kHz sample. Python's ``audioop`` did this but was removed in 3.13, so it is done
here with numpy: each direction is one table lookup. The encode tables cover all 65536
int16 values (64 KiB each, built once at import in ~3 ms), the decode tables
the 256 codes, and both are computed from the reference algorithm (the one in the ITU's
and Sun's public g711.c), so an encode is ``table[pcm.view(uint16)]``, whatever its size.

Encoding truncates towards the segment's floor and decoding returns the middle of the
quantisation step, so a round trip errs by at most half a step (4 at the smallest
magnitudes, 3% of the value at most above them), except beyond the largest code
(mu-law +-32124, A-law +-32256), where values clip.
"""

from __future__ import annotations

import numpy as np

_MULAW_BIAS = 0x84  # 132: shifts the magnitude so every segment's floor is a power of two
_MULAW_CLIP = 32635  # the largest magnitude that still fits after the bias
_ALAW_XOR = 0x55  # A-law inverts every other bit (ITU), so idle lines are not all zeros


def _segment(magnitude: np.ndarray, floor_shift: int) -> np.ndarray:
    """The segment (exponent, 0..7) of each magnitude: segment s starts at 2**(s+floor_shift)."""
    seg = np.zeros(magnitude.shape, np.int32)
    for s in range(1, 8):
        seg += magnitude >= (1 << (s + floor_shift))
    return seg


def _mulaw_encode_table() -> np.ndarray:
    pcm = np.arange(-32768, 32768, dtype=np.int32)
    sign = np.where(pcm < 0, 0x80, 0)
    biased = np.minimum(np.abs(pcm), _MULAW_CLIP) + _MULAW_BIAS
    exponent = _segment(biased, 7)
    mantissa = (biased >> (exponent + 3)) & 0x0F
    codes = ~(sign | (exponent << 4) | mantissa) & 0xFF
    return _by_uint16(codes)


def _alaw_encode_table() -> np.ndarray:
    pcm = np.arange(-32768, 32768, dtype=np.int32) >> 3  # A-law codes 13 bits
    positive = pcm >= 0
    mask = np.where(positive, 0xD5, 0x55)  # the sign bit (set = positive) and the XOR
    magnitude = np.where(positive, pcm, -pcm - 1)
    seg = _segment(magnitude, 4)  # segment ends 0x1F, 0x3F, ..., 0xFFF
    shift = np.maximum(seg, 1)  # segments 0 and 1 share the step (linear near zero)
    codes = (seg << 4) | ((magnitude >> shift) & 0x0F)
    return _by_uint16(codes ^ mask)


def _by_uint16(codes: np.ndarray) -> np.ndarray:
    """Reorder a table indexed by int16 value (from -32768) to one indexed by its bits."""
    return np.roll(codes.astype(np.uint8), -32768)


def _mulaw_decode_table() -> np.ndarray:
    code = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((code & 0x0F) << 3) + _MULAW_BIAS) << ((code & 0x70) >> 4)
    return np.where(code & 0x80, _MULAW_BIAS - t, t - _MULAW_BIAS).astype(np.int16)


def _alaw_decode_table() -> np.ndarray:
    code = np.arange(256, dtype=np.int32) ^ _ALAW_XOR
    seg = (code & 0x70) >> 4
    t = (code & 0x0F) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    return np.where(code & 0x80, t, -t).astype(np.int16)


MULAW_ENCODE = _mulaw_encode_table()
ALAW_ENCODE = _alaw_encode_table()
MULAW_DECODE = _mulaw_decode_table()
ALAW_DECODE = _alaw_decode_table()
for _table in (MULAW_ENCODE, ALAW_ENCODE, MULAW_DECODE, ALAW_DECODE):
    _table.setflags(write=False)


def _as_int16(pcm: np.ndarray) -> np.ndarray:
    if pcm.dtype != np.int16:
        raise TypeError(f"G.711 encodes int16 PCM, got {pcm.dtype}")
    return np.ascontiguousarray(pcm)


def mulaw_encode(pcm: np.ndarray) -> bytes:
    """int16 samples -> mu-law bytes, one per sample."""
    return MULAW_ENCODE[_as_int16(pcm).view(np.uint16)].tobytes()


def alaw_encode(pcm: np.ndarray) -> bytes:
    """int16 samples -> A-law bytes, one per sample."""
    return ALAW_ENCODE[_as_int16(pcm).view(np.uint16)].tobytes()


def mulaw_decode(data: bytes) -> np.ndarray:
    """mu-law bytes -> int16 samples."""
    return MULAW_DECODE[np.frombuffer(data, np.uint8)]


def alaw_decode(data: bytes) -> np.ndarray:
    """A-law bytes -> int16 samples."""
    return ALAW_DECODE[np.frombuffer(data, np.uint8)]

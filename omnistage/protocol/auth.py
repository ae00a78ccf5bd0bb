"""Control-plane message authentication: HMAC-SHA256 with a timestamp and a nonce.

With a shared token (--omni-auth-token / OMNISTAGE_AUTH_TOKEN) every registration,
HELLO and heartbeat carries ``{"ts", "nonce", "mac"}``; the MAC covers the message bytes,
the timestamp and the nonce. The receiver refuses a missing or wrong MAC (forged or
wrong token), a timestamp outside the freshness window (stale), and a nonce it has
already seen within that window (replayed). The data plane is not covered.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from omnistage.protocol.errors import ProtocolError

# How far a message's timestamp may be from the receiver's clock.
FRESH_WINDOW_S = 30.0
_MAX_NONCES = 100_000


class AuthStamp(msgspec.Struct, array_like=True):
    ts: float
    nonce: bytes
    mac: bytes


def _mac(token: bytes, payload: bytes, ts: float, nonce: bytes) -> bytes:
    msg = b"%r|" % ts + nonce + b"|" + payload
    return hmac.new(token, msg, hashlib.sha256).digest()


class Signer:
    def __init__(self, token: str, clock: Callable[[], float] = time.time) -> None:
        self._token = token.encode()
        self._clock = clock

    def stamp(self, payload: bytes) -> AuthStamp:
        ts, nonce = self._clock(), os.urandom(12)
        return AuthStamp(ts, nonce, _mac(self._token, payload, ts, nonce))


class Verifier:
    """Checks stamps; remembers recent nonces to refuse replays (bounded memory)."""

    def __init__(self, token: str, clock: Callable[[], float] = time.time) -> None:
        self._token = token.encode()
        self._clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def check(self, payload: bytes, stamp: AuthStamp | None) -> None:
        if stamp is None:
            raise ProtocolError("unauthenticated message (this head requires --omni-auth-token)")
        expected = _mac(self._token, payload, stamp.ts, stamp.nonce)
        if not hmac.compare_digest(expected, stamp.mac):
            raise ProtocolError("authentication failed: wrong --omni-auth-token or forged message")
        now = self._clock()
        if abs(now - stamp.ts) > FRESH_WINDOW_S:
            raise ProtocolError(f"stale message ({now - stamp.ts:+.0f}s old; clocks out of sync?)")
        self._forget(now)
        if stamp.nonce in self._seen:
            raise ProtocolError("replayed message")
        self._seen[stamp.nonce] = stamp.ts
        if len(self._seen) > _MAX_NONCES:
            self._seen.popitem(last=False)

    def _forget(self, now: float) -> None:
        while self._seen:
            nonce, ts = next(iter(self._seen.items()))
            if now - ts <= FRESH_WINDOW_S:
                return
            del self._seen[nonce]


_stamp_encoder = msgspec.msgpack.Encoder()
_stamp_decoder = msgspec.msgpack.Decoder(AuthStamp)


def encode_stamp(stamp: AuthStamp) -> bytes:
    return _stamp_encoder.encode(stamp)


def decode_stamp(raw: bytes) -> AuthStamp:
    try:
        return _stamp_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad authentication stamp: {exc}") from None

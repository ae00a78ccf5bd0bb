"""Ephemeral client secrets (``ek_...``) for the Realtime WebSocket.

A browser cannot set headers on a WebSocket, so it must not hold the real API key: a
backend mints a short-lived secret with ``POST /v1/realtime/client_secrets`` and hands
it to the page, which offers it in the subprotocol list. The secret is a signed token,
not a table entry, so any API server process of the head (``--api-server-count``)
verifies a secret another one minted, with no shared state:

    ek_ + base64url(JSON payload) + "." + base64url(HMAC-SHA256(payload))

keyed by a key derived from the API key (never the API key itself, so a token says
nothing about it). The payload holds the expiry, a nonce (two secrets minted in the
same second differ) and optionally the session config the secret starts sessions with.
A secret may be used for any number of sessions until it expires, as OpenAI's; it is
accepted only on the Realtime WebSocket (the API key middleware sees to that).

Everything in a token is a header's worth: the uvicorn WebSocket parser takes header
lines of at most 8 KiB, so the session config is capped at ``MAX_SESSION_BYTES``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec

PREFIX = "ek_"
MIN_TTL_S = 10
MAX_TTL_S = 7200
DEFAULT_TTL_S = 600
# JSON bytes of the session config a secret carries: base64 makes it 4/3 larger, and the
# whole token, with "openai-insecure-api-key." before it, must fit an 8 KiB header line.
MAX_SESSION_BYTES = 4096
# Anything longer cannot be a token this module minted: refused before any decoding.
MAX_TOKEN_CHARS = 8192

# Without --api-key every WebSocket is let in, and a secret only carries its session
# config and expiry; a fixed key is enough for that, and the same in every process.
_OPEN_KEY = "omnistage: no api key"
_KEY_CONTEXT = b"omnistage realtime client secret v1"
_SHAPE = re.compile(r"ek_[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")


class SecretPayload(msgspec.Struct, forbid_unknown_fields=True):
    expires_at: int
    nonce: str
    session: dict[str, Any] | None = None


class ClientSecrets:
    """Mints and verifies ``ek_`` tokens under one API key (``None``: no key)."""

    def __init__(self, api_key: str | None, clock: Callable[[], float] = time.time) -> None:
        secret = (api_key if api_key is not None else _OPEN_KEY).encode()
        self._key = hmac.new(secret, _KEY_CONTEXT, hashlib.sha256).digest()
        self._clock = clock

    def mint(self, session: dict[str, Any] | None, ttl_s: int) -> tuple[str, int]:
        """A token good for ``ttl_s`` seconds from now, and its expiry (unix seconds)."""
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl_s must be in [{MIN_TTL_S}, {MAX_TTL_S}], got {ttl_s}")
        if session is not None and session_size(session) > MAX_SESSION_BYTES:
            raise ValueError(f"session config over {MAX_SESSION_BYTES} bytes")
        expires_at = int(self._clock()) + ttl_s
        payload = _b64(
            msgspec.json.encode(SecretPayload(expires_at, secrets.token_hex(8), session))
        )
        return f"{PREFIX}{payload}.{_b64(self._sign(payload))}", expires_at

    def verify(self, token: str) -> SecretPayload | None:
        """The token's payload if this key signed it and it has not expired, else None."""
        if len(token) > MAX_TOKEN_CHARS or not _SHAPE.fullmatch(token):
            return None
        payload, _, signature = token[len(PREFIX) :].partition(".")
        given = _unb64(signature)
        # Constant-time: a forger learns nothing from how long a wrong signature took.
        if given is None or not hmac.compare_digest(given, self._sign(payload)):
            return None
        raw = _unb64(payload)
        if raw is None:
            return None
        try:
            decoded = msgspec.json.decode(raw, type=SecretPayload)
        except msgspec.DecodeError:
            return None
        return decoded if self._clock() < decoded.expires_at else None

    def _sign(self, payload: str) -> bytes:
        return hmac.new(self._key, payload.encode("ascii"), hashlib.sha256).digest()


def session_size(session: dict[str, Any]) -> int:
    """Bytes of ``session`` in a token (compact JSON)."""
    return len(msgspec.json.encode(session))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes | None:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None

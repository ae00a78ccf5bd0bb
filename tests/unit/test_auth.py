"""HMAC stamps: forged, stale and replayed messages are refused."""

from __future__ import annotations

import pytest

from omnistage.protocol.auth import FRESH_WINDOW_S, Signer, Verifier
from omnistage.protocol.errors import ProtocolError
from tests.unit.fakes import FakeClock


def test_a_good_stamp_passes_once() -> None:
    clock = FakeClock(1000.0)
    stamp = Signer("k", clock).stamp(b"payload")
    verifier = Verifier("k", clock)
    verifier.check(b"payload", stamp)
    with pytest.raises(ProtocolError, match="replayed"):
        verifier.check(b"payload", stamp)


def test_tampering_wrong_key_missing_and_stale_are_refused() -> None:
    clock = FakeClock(1000.0)
    verifier = Verifier("k", clock)
    stamp = Signer("k", clock).stamp(b"payload")
    with pytest.raises(ProtocolError, match="authentication failed"):
        verifier.check(b"payl0ad", stamp)
    with pytest.raises(ProtocolError, match="authentication failed"):
        verifier.check(b"payload", Signer("other", clock).stamp(b"payload"))
    with pytest.raises(ProtocolError, match="unauthenticated"):
        verifier.check(b"payload", None)
    old = Signer("k", lambda: clock.now - FRESH_WINDOW_S - 1).stamp(b"payload")
    with pytest.raises(ProtocolError, match="stale"):
        verifier.check(b"payload", old)


def test_nonces_are_forgotten_after_the_window() -> None:
    clock = FakeClock(1000.0)
    verifier = Verifier("k", clock)
    for _ in range(100):
        verifier.check(b"x", Signer("k", clock).stamp(b"x"))
    clock.now += FRESH_WINDOW_S + 1
    verifier.check(b"x", Signer("k", clock).stamp(b"x"))
    assert len(verifier._seen) == 1

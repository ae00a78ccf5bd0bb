"""The head's side of HELLO -> init: tells a freshly registered replica how to serve.

READY comes back on the input channel (see ``messages.Ready``), where the data plane
checks it; a replica that never sends it is expired by the replica table after
--stage-init-timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from omnistage.control.slots import SlotTable
from omnistage.logs import Throttled
from omnistage.protocol import codec
from omnistage.protocol.auth import Verifier
from omnistage.protocol.errors import ProtocolError
from omnistage.protocol.messages import PROTOCOL_VERSION, HandshakeInit, Hello

log = logging.getLogger(__name__)
_bad_input = Throttled(log)


class HandshakeServer:
    def __init__(
        self,
        slots: SlotTable,
        lock: threading.Lock,
        init_for: Callable[[int], HandshakeInit],
        verifier: Verifier | None = None,
    ) -> None:
        self._verifier = verifier
        self._slots = slots
        self._lock = lock
        self._init_for = init_for

    def handle(self, frames: list[bytes]) -> list[bytes] | None:
        identity = frames[0]
        try:
            hello = codec.decode_signed(frames[1:], self._verifier, Hello)
        except ProtocolError as exc:
            _bad_input.warning("handshake dropped a message: %s", exc)
            return None
        init = self._answer(hello)
        if init.error:
            log.warning("handshake refused for stage %d: %s", hello.stage_id, init.error)
        return [identity, *codec.encode(init)]

    def _answer(self, hello: Hello) -> HandshakeInit:
        if hello.protocol_version != PROTOCOL_VERSION:
            return _refusal(
                f"protocol_version {hello.protocol_version} != head's {PROTOCOL_VERSION}"
            )
        with self._lock:
            current = self._slots.is_current(hello.stage_id, hello.replica_id, hello.epoch)
        if not current:
            return _refusal(
                f"stage {hello.stage_id} replica {hello.replica_id} epoch {hello.epoch} "
                "is not a current registration; register again"
            )
        return self._init_for(hello.stage_id)


def _refusal(message: str) -> HandshakeInit:
    return HandshakeInit(
        stage_config={},
        input_address="",
        output_address="",
        coordinator_address="",
        heartbeat_interval_s=0.0,
        stage_init_timeout_s=0.0,
        error=message,
    )

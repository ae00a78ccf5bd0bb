"""The connectors by name, the head's choice of one per edge, and a replica's set of them.

The head picks each direct edge's connector from the deploy config (``choose``), falling
back to zmq when the configured one needs both replicas on one host and they are not; the
sending replica applies it per peer (``Connectors.outbound``) and the receiving replica
resolves what arrives by reference (``Connectors.inbound``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from omnistage.config.schema import ConnectorConfig
from omnistage.connectors.base import Connector, ConnectorError
from omnistage.connectors.inline import ZmqConnector
from omnistage.connectors.shm import ShmConnector
from omnistage.logs import Throttled
from omnistage.protocol.chunk_meta import TensorMeta
from omnistage.protocol.messages import OutputChunk, PeerConnector

log = logging.getLogger(__name__)
_lost = Throttled(log)

_CLASSES: tuple[type[ZmqConnector] | type[ShmConnector], ...] = (ZmqConnector, ShmConnector)
FACTORIES: dict[str, Callable[[], Connector]] = {cls.name: cls for cls in _CLASSES}
# Connectors that need both replicas to see the same memory.
SAME_HOST_ONLY = frozenset(cls.name for cls in _CLASSES if cls.same_host_only)
ZMQ = PeerConnector("zmq")


def choose(
    conf: ConnectorConfig | None, src_host: str, dst_host: str
) -> tuple[PeerConnector, bool]:
    """The connector an edge's sender uses toward one receiver, and whether it is a
    fallback (the configured one needs one host, and the two replicas' shared memory
    differs or is unknown)."""
    if conf is None or conf.name == "zmq":
        return ZMQ, False
    if conf.name in SAME_HOST_ONLY and not (src_host and src_host == dst_host):
        return ZMQ, True
    return PeerConnector(conf.name, {"segment_bytes": conf.segment_bytes, **conf.extra}), False


class Connectors:
    """The connectors one replica's data-plane session uses, made when first needed."""

    def __init__(self) -> None:
        self._made: dict[str, Connector] = {}

    def _get(self, name: str) -> Connector:
        conn = self._made.get(name)
        if conn is None:
            make = FACTORIES.get(name)
            if make is None:
                raise ConnectorError(f"unknown connector {name!r}")
            conn = self._made[name] = make()
        return conn

    def outbound(
        self, peer: str, choice: PeerConnector, chunks: list[OutputChunk]
    ) -> list[OutputChunk]:
        """``chunks`` as they go to ``peer`` on the data plane: each tensor payload given
        to ``choice``'s connector, which may replace its bytes by a reference."""
        if choice.name == "zmq":
            return chunks
        conn = self._get(choice.name)
        out = []
        for chunk in chunks:
            if chunk.data and isinstance(chunk.meta, TensorMeta):
                moved = conn.send(peer, chunk, choice.options)
                out.append(chunk if moved is None else moved)
            else:
                out.append(chunk)
        return out

    def inbound(self, chunk: OutputChunk) -> bool:
        """Put back the bytes of a chunk that came by reference; False (logged) when they
        cannot be had, and the chunk must be dropped."""
        ref = chunk.ref
        if ref is None:
            return True
        try:
            chunk.data = self._get(ref.connector).receive(ref)
        except (ConnectorError, OSError, ValueError) as exc:
            _lost.warning("dropped a chunk of request %s: %s", chunk.request_id, exc)
            return False
        chunk.ref = None
        return True

    def forget_peer(self, peer: str) -> None:
        for conn in self._made.values():
            conn.forget_peer(peer)

    def prune(self) -> None:
        for conn in self._made.values():
            conn.prune()

    def close(self) -> None:
        for conn in self._made.values():
            conn.close()
        self._made.clear()

"""The ``zmq`` connector: tensor bytes travel inline in the chunk on the data plane (the
replica-to-replica PUSH/PULL, or through the head on edges that go through it). The
default, and what every other connector falls back to."""

from __future__ import annotations

from typing import Any

from omnistage.connectors.base import ConnectorError
from omnistage.protocol.messages import OutputChunk, PayloadRef


class ZmqConnector:
    name = "zmq"
    same_host_only = False

    def send(self, peer: str, chunk: OutputChunk, options: dict[str, Any]) -> OutputChunk | None:
        return None

    def receive(self, ref: PayloadRef) -> bytes:
        raise ConnectorError("the zmq connector carries its bytes inline, never by reference")

    def forget_peer(self, peer: str) -> None:
        pass

    def prune(self) -> None:
        pass

    def close(self) -> None:
        pass

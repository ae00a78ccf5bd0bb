"""The connector interface: how one edge's tensor payloads go from a replica of a stage
to a replica of the next.

A connector sees only chunks whose ``data`` is a tensor (``TensorMeta``). On the sending
replica, ``send`` takes a chunk's bytes for one peer and returns what travels on the data
plane instead (a copy of the chunk with ``data`` moved out and a ``PayloadRef`` in its
place), or None to leave the bytes inline. On the receiving replica, ``receive`` turns a
``PayloadRef`` back into the bytes, before the engine sees the chunk. Engines never see a
connector: a new one (a transfer engine across hosts, say) is a module here and a name in
the registry and the config, nothing in the stages.
"""

from __future__ import annotations

from typing import Any, Protocol

from omnistage.protocol.messages import OutputChunk, PayloadRef


class Connector(Protocol):
    # As named in a stage's ``connector_config`` and in ``PayloadRef.connector``.
    name: str
    # Whether both replicas must see the same memory (the head falls back to zmq if not).
    same_host_only: bool

    def send(self, peer: str, chunk: OutputChunk, options: dict[str, Any]) -> OutputChunk | None:
        """What of ``chunk`` goes to ``peer`` on the data plane: a copy whose bytes this
        connector carries, or None (the bytes go inline). ``chunk`` itself is not changed:
        the same object may go to the head and to other peers."""
        ...

    def receive(self, ref: PayloadRef) -> bytes:
        """The bytes ``ref`` points at, handed over to the caller (the connector frees
        its copy). Raises ``ConnectorError`` when they cannot be had."""
        ...

    def forget_peer(self, peer: str) -> None:
        """The data-plane socket to ``peer`` was closed: release what was kept for it."""
        ...

    def prune(self) -> None:
        """Periodically: release what was kept for partners that are gone."""
        ...

    def close(self) -> None: ...


class ConnectorError(Exception):
    """A payload a ``PayloadRef`` points at cannot be had."""

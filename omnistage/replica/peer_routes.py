"""Where a replica's outputs go, per request, and what it keeps for a replacement peer.

Each output goes to the head when it needs it (``AddRequest.head_all``, or the last
chunk, or an error) and to every downstream peer the head named. A final stage whose
tensors go replica to replica (``AddRequest.peer_tensors``) sends its tensor chunks to
the peers only, and keeps everything it sent them until the head ends the request
(Abort): when a downstream replica is lost, the head names its replacement (Redirect)
and the kept chunks go there again, so this stage, whose text the client already has,
never runs twice. Memory: what one request sent its peers, held only while the head
holds the request (or until this replica leaves the head), for at most ``MAX_KEPT``
requests (the oldest dropped first: one whose end never came). Plain state, no I/O.

A retry that runs again from the start (``ReplayFilter``) drops what the client has from
the head's chunks only: its peers run again from their start too, and get it all.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from omnistage import envs
from omnistage.protocol.messages import (
    AddRequest,
    OutputChunk,
    PeerConnector,
    Redirect,
    is_tensor,
)
from omnistage.replica.outputs import ReplayFilter

_ZMQ = PeerConnector("zmq")

# Requests whose sent chunks a replica keeps at most: far above any replica's capacity,
# so only requests whose end (Abort) never came are dropped (OMNISTAGE_PEER_KEPT_REQUESTS
# sets another; a request dropped is run again when its peer is replaced).
MAX_KEPT = 4096

# (peer address, connector name) -> the connector and the chunks for that peer (a
# connector holds a dict: not hashable itself).
PeerBatches = dict[tuple[str, str], tuple[PeerConnector, list[OutputChunk]]]


@dataclass(slots=True)
class _Peer:
    address: str
    connector: PeerConnector
    # Stamped on what it is sent: a replacement peer runs a later attempt than ours.
    attempt: int


@dataclass(slots=True)
class _Route:
    attempt: int
    head_all: bool
    peer_tensors: bool
    peers: list[_Peer]
    replay: ReplayFilter | None
    skipped: int = 0  # chunks the head had all of (``replay``): not numbered for it


def _peers(addresses: list[str], connectors: list[PeerConnector], attempt: int) -> list[_Peer]:
    conns = list(connectors[: len(addresses)])
    conns += [_ZMQ] * (len(addresses) - len(conns))
    return [_Peer(a, c, attempt) for a, c in zip(addresses, conns, strict=True)]


def _put(batches: PeerBatches, peer: _Peer, chunk: OutputChunk) -> None:
    if chunk.attempt != peer.attempt:
        chunk = msgspec.structs.replace(chunk, attempt=peer.attempt)
    batches.setdefault((peer.address, peer.connector.name), (peer.connector, []))[1].append(chunk)


def _unseen(route: _Route, chunk: OutputChunk, to_head: list[OutputChunk]) -> None:
    """What of ``chunk`` the head has not had, if anything, numbered on from the last
    chunk it was sent."""
    assert route.replay is not None
    text, data = route.replay.apply(chunk.text, chunk.data)
    if not (text or data or chunk.finished):
        route.skipped += 1
        return
    if text is not chunk.text or data is not chunk.data or route.skipped:
        chunk = msgspec.structs.replace(chunk, text=text, data=data, seq=chunk.seq - route.skipped)
    to_head.append(chunk)


class PeerRoutes:
    def __init__(self) -> None:
        limit = envs.peer_kept_requests()
        self.max_kept = MAX_KEPT if limit is None else limit
        self._routes: dict[str, _Route] = {}
        # Request id -> what it sent its peers (``peer_tensors`` routes only).
        self._kept: dict[str, list[OutputChunk]] = {}

    def add(self, msg: AddRequest, replay: ReplayFilter | None = None) -> None:
        """Route the request's outputs; ``replay``: what of them the head has already."""
        rid = msg.request_id
        peers = _peers(msg.peers, msg.connectors, msg.attempt)
        self._routes[rid] = _Route(msg.attempt, msg.head_all, msg.peer_tensors, peers, replay)
        if msg.peer_tensors:
            self._kept.pop(rid, None)  # a retry of it: newest again
            self._kept[rid] = []
            while len(self._kept) > self.max_kept:
                del self._kept[next(iter(self._kept))]
        else:
            self._kept.pop(rid, None)

    def route(self, chunks: list[OutputChunk]) -> tuple[list[OutputChunk], PeerBatches]:
        """Split one tick's outputs into the head's and each peer's."""
        to_head: list[OutputChunk] = []
        to_peers: PeerBatches = {}
        for chunk in chunks:
            rid = chunk.request_id
            route = self._routes.get(rid)
            if route is None or route.attempt != chunk.attempt:
                to_head.append(chunk)  # a late chunk of an earlier attempt: the head drops it
                continue
            if chunk.finished or (route.head_all and not (route.peer_tensors and is_tensor(chunk))):
                if route.replay is None:
                    to_head.append(chunk)
                else:
                    _unseen(route, chunk, to_head)
            for peer in route.peers:
                _put(to_peers, peer, chunk)
            if route.peer_tensors:
                kept = self._kept.get(rid)
                if kept is not None:
                    kept.append(chunk)
            if chunk.finished:
                del self._routes[rid]
        return to_head, to_peers

    def redirect(self, msg: Redirect) -> PeerBatches | None:
        """Point a request at its replacement peers; what to send them now (None: nothing
        was kept for it)."""
        kept = self._kept.get(msg.request_id)
        if kept is None:
            return None
        new = _peers(msg.peers, msg.connectors, msg.attempt)
        route = self._routes.get(msg.request_id)
        if route is not None:  # still running: the rest of its outputs go there too
            gone = set(msg.gone)
            route.peers = [p for p in route.peers if p.address not in gone] + new
        out: PeerBatches = {}
        for peer in new:
            for chunk in kept:
                _put(out, peer, chunk)
        return out

    def release(self, request_id: str) -> None:
        """The head ended the request: nothing can ask for its kept chunks again."""
        self._kept.pop(request_id, None)

    def kept_chunks(self) -> int:
        return sum(len(k) for k in self._kept.values())

    def clear(self) -> None:
        self._routes.clear()
        self._kept.clear()

"""One request's state in the orchestrator: per stage, the replica it is bound to and what
the head keeps for a retry; and which edges of the graph carry its outputs replica to
replica. Plain state, no I/O."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from omnistage.control.balancing.prefix_index import RequestPrefix
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.stage_pool import ReplicaHandle
from omnistage.dataplane.streamed import StreamedInput
from omnistage.net import is_loopback, is_loopback_url
from omnistage.protocol.messages import OutputChunk, Prompt, Resume, Usage
from omnistage.protocol.params import StageParams


class Done:
    """Queued after the last output of a request."""


DONE = Done()


@dataclass(slots=True)
class StageProgress:
    """One stage's part of a request, kept until the stage finishes it, for a retry."""

    # Inputs the head forwarded to the stage (edges through the head), replayed to a
    # replacement replica.
    inputs: list[OutputChunk] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    data_chunks: int = 0
    tokens: int = 0  # completion tokens so far, when the stage's chunks say
    next_seq: int = 0
    retries: int = 0
    busy: int = 0  # BUSY refusals (replicas shared by several heads)
    dispatches: int = 0
    # The run attempt this stage's current dispatch belongs to (see AddRequest.attempt).
    attempt: int = 0
    # A dispatch is waiting for a replica; inputs queue in ``inputs`` meanwhile.
    waiting: bool = False
    # Clock readings for the latency histograms (``dataplane.latency``): when a retry
    # started waiting (None: the first dispatch waits from the request's open), the
    # current dispatch, and its first output (None: none yet).
    waiting_since: float | None = None
    dispatched_at: float = 0.0
    first_at: float | None = None

    def resume(self) -> Resume | None:
        """What a re-dispatch must not deliver again (None on the first dispatch)."""
        if self.dispatches <= 1:
            return None
        return Resume(
            text="".join(self.text),
            data_chunks=self.data_chunks,
            seq=self.next_seq,
            tokens=self.tokens,
        )

    def restart_hidden(self) -> None:
        """A stage whose outputs the head does not see runs again from its start (all
        that received them run again too): a fresh dispatch, nothing to resume."""
        self.text, self.data_chunks, self.next_seq, self.dispatches = [], 0, 0, 0
        self.tokens = 0


@dataclass(slots=True)
class Run:
    request_id: str
    prompt: Prompt
    params: dict[int, StageParams]
    active: set[int]
    finals: set[int]
    queue: asyncio.Queue[OutputChunk | BaseException | Done] = field(default_factory=asyncio.Queue)
    assigned: dict[int, ReplicaHandle] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    usage: dict[int, Usage] = field(default_factory=dict)
    stages: dict[int, StageProgress] = field(default_factory=dict)
    # Edges (upstream, downstream) whose chunks go replica to replica.
    direct: set[tuple[int, int]] = field(default_factory=set)
    # Final stages whose replica keeps what it sent over its direct edges
    # (AddRequest.peer_tensors): a lost downstream replica is fed again from there.
    keepers: set[int] = field(default_factory=set)
    # Final stages whose last chunk the client has: one run again only to feed its
    # peers (a keeper that kept nothing) sends the client nothing more.
    delivered: set[int] = field(default_factory=set)
    attempt: int = 0
    ack: bool = False  # final stages acknowledge their params first (AddRequest.ack)
    affinity: str = ""  # PipelineRequest.affinity: the key replicas stick to
    # The chat prompt's prefix keys, for the cache-aware stages reading it (None: no
    # such stage in the request, or no chat messages).
    prefix: RequestPrefix | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    failed: bool = False
    # The input fed so far, when it is streamed (``PipelineRequest.input_streaming``),
    # and the stages that read it (those given the prompt).
    streamed: StreamedInput | None = None
    readers: set[int] = field(default_factory=set)
    # Clock readings for the latency histograms (``dataplane.latency``).
    opened_at: float = 0.0
    first_text_at: float | None = None
    first_audio_at: float | None = None

    def fail(self, exc: BaseException) -> None:
        if not self.failed:
            self.failed = True
            self.queue.put_nowait(exc)

    def progress(self, sid: int) -> StageProgress:
        st = self.stages.get(sid)
        if st is None:
            st = self.stages[sid] = StageProgress()
        return st


def direct_edge(graph: StageGraph, run: Run, up: int, down: int) -> bool:
    """Whether ``up``'s outputs go straight to ``down``'s replica: into replicas that
    listen for peers, and reachable (a loopback address serves only senders on the same
    host, which the head knows only of loopback senders).

    Out of a final stage only on a tensor edge (``StageGraph.tensor_edges``): the head
    still gets the stage's other chunks, its tensors go to the peers only. Another edge
    out of a final stage stays with the head: a downstream stage that reads its text
    would get only what follows on a resumed run (an LLM continues after the text the
    client has), where its tensors are all sent again."""
    if up in run.finals and (up, down) not in graph.tensor_edges:
        return False
    src, dst = run.assigned[up], run.assigned[down]
    if not dst.peer_address:
        return False
    return not is_loopback_url(dst.peer_address) or is_loopback(src.address)


def restart_group(run: Run, failed: int) -> set[int]:
    """The stages to dispatch again when ``failed``'s replica is lost: those joined to it
    by direct edges (their chunks to it, or from it, are gone with it), transitively;
    but not a keeper upstream of them, which feeds the new replicas again (``redirects``)."""
    group = {failed}
    todo = [failed]
    while todo:
        sid = todo.pop()
        for up, down in run.direct:
            other = down if up == sid else up if down == sid else None
            if other is None or other in group or (other == up and other in run.keepers):
                continue
            group.add(other)
            todo.append(other)
    return group


# Keeper stage -> the stages it feeds again after a failure -> their lost replicas' peer
# addresses (``redirects``).
Feeds = dict[int, dict[int, str]]


def redirects(run: Run, group: set[int]) -> Feeds:
    """The keepers outside ``group`` that fed stages of it over direct edges: per keeper,
    each such stage and the peer address of its replica now (lost with it)."""
    out: Feeds = {}
    for up, down in run.direct:
        if up in run.keepers and up not in group and down in group:
            handle = run.assigned.get(down)
            out.setdefault(up, {})[down] = handle.peer_address if handle is not None else ""
    return out

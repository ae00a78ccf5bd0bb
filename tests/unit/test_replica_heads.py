"""Which of the fleet's heads a headless replica goes on to serve (``ReplicaRuntime``'s
``_learn_heads``): the links it makes, not the links' own registration (the fleet tests
run that for real)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from omnistage.replica import runtime
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.runtime import ReplicaRuntime

FIRST, B, C = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3"


class Link:
    """Stands in for ``OtherHead``: a link made, never connected."""

    def __init__(self, _ctx: Any, _opts: Any, master: str, **_: Any) -> None:
        self.master, self.connected, self.started = master, False, False

    def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        pass


@pytest.fixture
def replica(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReplicaRuntime]:
    monkeypatch.setattr(runtime, "OtherHead", Link)
    replica = ReplicaRuntime(
        ReplicaOptions(stage_id=0, master_host="127.0.0.1", master_port=1, rejoin=True)
    )
    replica._loop = asyncio.new_event_loop()
    yield replica
    replica._loop.close()
    replica._ctx.term()


def test_the_first_heads_list_makes_a_link_to_each_other_head(replica: ReplicaRuntime) -> None:
    replica._learn_heads("", [FIRST, B, C])
    assert sorted(replica._others) == [B, C]
    assert all(link.started for link in replica._others.values())


def test_no_link_is_made_while_the_replica_leaves_its_id(replica: ReplicaRuntime) -> None:
    # The race a fleet test hit: a head's list came while the replica gave its id up;
    # the link made then registered under the old id and held it at that head.
    replica._moving = True
    replica._learn_heads("", [FIRST, B, C])
    replica._learn_heads(B, [B, FIRST, C])
    assert replica._others == {}


def test_a_link_let_go_names_no_more_heads(replica: ReplicaRuntime) -> None:
    replica._learn_heads("", [FIRST, B])
    replica._others.pop(B)  # let go (the replica moved, or the first head forgot it)
    replica._learn_heads(B, [B, FIRST, C])
    assert replica._others == {}
    replica._learn_heads("", [FIRST, B, C])  # the first head's list still counts
    assert sorted(replica._others) == [B, C]

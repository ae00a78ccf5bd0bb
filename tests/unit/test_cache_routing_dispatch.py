"""Cache-aware routing through a real Orchestrator: prefix keys are computed only for
requests a cache-aware stage reads the chat prompt of, given only to those stages'
pools, and a finished stage's usage is added to the replica that served it."""

from __future__ import annotations

from omnistage.config.load import load_config
from omnistage.control.balancing import make_policy
from omnistage.control.replica_table import Transition
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.orchestrator import Orchestrator
from omnistage.dataplane.stage_pool import StagePool
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import (
    ChatMessage,
    OutputChunk,
    Prompt,
    Reason,
    ReplicaState,
    Usage,
)
from omnistage.protocol.prefix import prefix_keys
from tests.unit.test_orchestrator_retry import FakeChannels, collect, entry

CHAT = Prompt(
    messages=[
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hello"),
    ]
)


def _head(policies: dict[int, str]) -> tuple[Orchestrator, dict[int, StagePool]]:
    """The three-stage echo chain, two replicas per stage, each with its policy."""
    config = load_config("echo")
    pools = {
        s.stage_id: StagePool(s.stage_id, s.name, make_policy(policies[s.stage_id]))
        for s in config.stages
    }
    orch = Orchestrator(StageGraph(config), pools, FakeChannels())  # type: ignore[arg-type]
    for sid in pools:
        for rid in range(2):
            e = entry(sid, rid, ReplicaState.UP)
            orch.on_transition(Transition(e, ReplicaState.STARTING, ReplicaState.UP, Reason.READY))
    return orch, pools


def _bound(pool: StagePool, request_id: str) -> int:
    (rid,) = [h.replica_id for h in pool.replicas.values() if request_id in h.requests]
    return rid


async def test_only_a_cache_aware_stage_reading_the_prompt_gets_its_keys():
    # The talker (stage 1) is cache-aware too, but reads the thinker's output, not the
    # chat: its index must not fill with the chat's keys.
    orch, pools = _head({0: "cache-aware", 1: "cache-aware", 2: "random"})
    await orch.open(PipelineRequest("r1", CHAT, [2]))
    thinker = _bound(pools[0], "r1")
    assert pools[0].prefixes is not None and pools[1].prefixes is not None
    assert pools[0].prefixes.replicas() == {thinker}
    assert pools[0].prefixes.routed_count(thinker) == len(prefix_keys(CHAT.messages))
    assert pools[1].prefixes.replicas() == set()
    assert pools[2].prefixes is None


async def test_no_keys_are_computed_without_a_cache_aware_stage_or_chat_messages():
    orch, _ = _head({0: "random", 1: "random", 2: "random"})
    await orch.open(PipelineRequest("r1", CHAT, [2]))
    assert orch._runs["r1"].prefix is None
    orch, _ = _head({0: "cache-aware", 1: "random", 2: "random"})
    await orch.open(PipelineRequest("r2", Prompt(text="plain"), [2]))
    assert orch._runs["r2"].prefix is None


async def test_a_finished_stages_usage_counts_for_the_replica_that_served_it():
    orch, pools = _head({0: "cache-aware", 1: "random", 2: "random"})
    stream = await orch.open(PipelineRequest("r1", CHAT, [0], only=True))
    rid = _bound(pools[0], "r1")
    usage = Usage(prompt_tokens=30, completion_tokens=5, cached_tokens=12)
    chunk = OutputChunk("r1", 0, rid, 1, 0, "text", "hi", finished=True, usage=usage)
    orch.on_outputs([chunk])
    await collect(stream)
    handle = pools[0].replicas[rid]
    assert (handle.prompt_tokens_total, handle.cached_tokens_total) == (30, 12)
    other = pools[0].replicas[1 - rid]
    assert (other.prompt_tokens_total, other.cached_tokens_total) == (0, 0)
    assert stream.usage().cached_tokens == 12

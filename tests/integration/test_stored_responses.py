"""Stored responses over a real echo head, with the openai SDK: ``store`` (default on),
``previous_response_id`` chains, reading back, input items, deleting, background
responses polled and cancelled, and rows visible only to the key that made them.

The echo stage runs with ``echo_messages``: it answers with every message it was sent,
so a test sees the whole conversation a chained request carried."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.integration.harness import HeadProc, wait_for

ECHO = {"0": {"engine_args": {"echo_messages": True, "num_chunks": 2, "suffix": ""}}}
SLOW = {"0": {"engine_args": {"echo_messages": True, "chunk_delay_s": 0.2, "hang_on": "HANG"}}}


def _head(tmp: Path, name: str, overrides: dict, *extra: str) -> HeadProc:
    store = f"sqlite:///{tmp / name}.db"
    return HeadProc(
        tmp,
        "echo-1stage",
        "--stage-overrides",
        json.dumps(overrides),
        "--store-url",
        store,
        "--media-url",
        str(tmp / f"{name}-media"),
        *extra,
        name=name,
    )


@pytest.fixture(scope="module")
def head(module_tmp: Path) -> Iterator[HeadProc]:
    h = _head(module_tmp, "stored", ECHO, "--api-key", "key-a,key-b")
    try:
        h.wait_healthy()
        yield h
    finally:
        h.stop()


def _sdk(head: HeadProc, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{head.url}/v1", api_key=key, max_retries=0)


def test_a_chained_turn_carries_the_stored_conversation_before_its_input(
    head: HeadProc,
) -> None:
    sdk = _sdk(head)
    first = sdk.responses.create(
        model="echo-1stage", input="my name is Ada", instructions="Be brief."
    )
    assert first.store is True
    second = sdk.responses.create(
        model="echo-1stage", input="what is my name?", previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    # The first turn's input and answer, then the new input; its instructions are not
    # carried over (as OpenAI does it).
    assert second.output_text == (
        f"user: my name is Ada\nassistant: {first.output_text}\nuser: what is my name?"
    )
    third = sdk.responses.create(
        model="echo-1stage", input="and again?", previous_response_id=second.id
    )
    assert third.output_text.startswith("user: my name is Ada\n")
    assert third.output_text.endswith(f"assistant: {second.output_text}\nuser: and again?")


def test_a_stored_response_reads_back_as_it_was_returned(head: HeadProc) -> None:
    sdk = _sdk(head)
    made = sdk.responses.create(model="echo-1stage", input="keep me", metadata={"k": "v"})
    got = sdk.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    items = sdk.responses.input_items.list(made.id)
    assert [i.type for i in items.data] == ["message"]
    assert items.data[0].content[0].text == "keep me"  # type: ignore[union-attr]
    assert items.data[0].id


def test_a_streamed_response_is_stored_too(head: HeadProc) -> None:
    sdk = _sdk(head)
    with sdk.responses.stream(model="echo-1stage", input="streamed turn") as stream:
        final = stream.get_final_response()
    assert (
        sdk.responses.retrieve(final.id).output_text == final.output_text == "user: streamed turn"
    )


def test_a_deleted_response_is_gone_and_cannot_be_continued(head: HeadProc) -> None:
    sdk = _sdk(head)
    made = sdk.responses.create(model="echo-1stage", input="short lived")
    sdk.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model="echo-1stage", input="x", previous_response_id=made.id)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_store_false_keeps_nothing(head: HeadProc) -> None:
    sdk = _sdk(head)
    made = sdk.responses.create(model="echo-1stage", input="forget me", store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(made.id)


def test_another_keys_responses_are_not_found(head: HeadProc) -> None:
    made = _sdk(head, "key-a").responses.create(model="echo-1stage", input="mine")
    other = _sdk(head, "key-b")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError):
        other.responses.create(model="echo-1stage", input="x", previous_response_id=made.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(made.id)
    assert _sdk(head, "key-a").responses.retrieve(made.id).id == made.id


def _poll(sdk: openai.OpenAI, rid: str, until: set[str], timeout: float = 20):
    def done():
        got = sdk.responses.retrieve(rid)
        return got if got.status in until else None

    return wait_for(done, timeout, 0.1, f"response {rid} in {until}")


@pytest.fixture(scope="module")
def slow_head(module_tmp: Path) -> Iterator[HeadProc]:
    h = _head(module_tmp, "background", SLOW)
    try:
        h.wait_healthy()
        yield h
    finally:
        h.stop()


def test_a_background_response_is_queued_then_completes(slow_head: HeadProc) -> None:
    sdk = _sdk(slow_head)
    queued = sdk.responses.create(model="echo-1stage", input="in the background", background=True)
    assert queued.status == "queued" and queued.background is True
    done = _poll(sdk, queued.id, {"completed", "failed"})
    assert done.status == "completed", done.error
    assert done.output_text == "user: in the background [echo]"
    chained = sdk.responses.create(
        model="echo-1stage", input="next", previous_response_id=queued.id
    )
    assert chained.output_text.startswith("user: in the background\nassistant: user: in the")


def test_a_cancelled_background_response_stops_its_generation(slow_head: HeadProc) -> None:
    sdk = _sdk(slow_head)
    made = sdk.responses.create(model="echo-1stage", input="HANG forever", background=True)
    _poll(sdk, made.id, {"in_progress"})
    wait_for(lambda: slow_head.replicas(0)[0]["in_flight"] == 1, 10, what="the job running")
    cancelled = sdk.responses.cancel(made.id)
    assert cancelled.status == "cancelled"
    # The runner finds its lease gone and aborts the request on the replica.
    wait_for(lambda: slow_head.replicas(0)[0]["in_flight"] == 0, 10, what="the job aborted")
    time.sleep(0.5)
    assert sdk.responses.retrieve(made.id).status == "cancelled"


def test_a_finished_response_cannot_be_cancelled_and_stays_as_it_was(slow_head: HeadProc) -> None:
    sdk = _sdk(slow_head)
    made = sdk.responses.create(model="echo-1stage", input="quick")
    with pytest.raises(openai.BadRequestError):
        sdk.responses.cancel(made.id)
    assert sdk.responses.retrieve(made.id).status == "completed"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "background": True, "store": False}, "store"),
        ({"input": "x", "background": True, "stream": True}, "stream"),
    ],
)
def test_background_needs_store_and_no_stream(slow_head: HeadProc, body: dict, param: str) -> None:
    r = slow_head.client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_jobs_made_through_api_server_processes_run_on_the_head(module_tmp: Path) -> None:
    """With --api-server-count 2 the routes run in other processes: each opens the store,
    and the head's runner (which polls the store) runs what they queue."""
    h = _head(module_tmp, "servers", ECHO, "--api-server-count", "2")
    try:
        h.wait_healthy()
        sdk = _sdk(h)
        made = [
            sdk.responses.create(model="echo-1stage", input=f"via {n}", background=True)
            for n in range(4)
        ]
        for n, queued in enumerate(made):
            done = _poll(sdk, queued.id, {"completed", "failed"})
            assert done.output_text == f"user: via {n}"
        chained = sdk.responses.create(
            model="echo-1stage", input="next", previous_response_id=made[0].id
        )
        assert chained.output_text == "user: via 0\nassistant: user: via 0\nuser: next"
    finally:
        h.stop()


def test_a_background_response_is_not_deleted_through_the_videos_route(
    slow_head: HeadProc,
) -> None:
    sdk = _sdk(slow_head)
    made = sdk.responses.create(model="echo-1stage", input="not a video", background=True)
    r = slow_head.client.delete(f"/v1/videos/{made.id}")
    assert r.status_code == 404
    assert _poll(sdk, made.id, {"completed", "failed"}).status == "completed"


def test_reading_back_is_not_streamed(slow_head: HeadProc) -> None:
    made = _sdk(slow_head).responses.create(model="echo-1stage", input="once")
    r = slow_head.client.get(f"/v1/responses/{made.id}", params={"stream": "true"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_a_background_response_whose_job_failed_unfinished_reads_as_failed(
    slow_head: HeadProc, module_tmp: Path
) -> None:
    """A job interrupted too often is failed by the store's claim, without its handler
    running: the stored response must not read "in_progress" for ever."""
    import asyncio

    from omnistage.store.open import open_store
    from omnistage.store.records import Job, JobKind, JobStatus, StoredResponse

    async def plant() -> None:
        store = open_store(f"sqlite:///{module_tmp / 'background'}.db")
        await store.start()
        body = {
            "id": "resp_lost",
            "object": "response",
            "status": "in_progress",
            "background": True,
        }
        await store.put_response(
            StoredResponse(
                id="resp_lost",
                owner=None,
                created_at=time.time(),
                status="in_progress",
                conversation="resp_lost",
                body=body,
            )
        )
        await store.create_job(
            Job(
                id="resp_lost",
                kind=JobKind.RESPONSE,
                owner=None,
                created_at=time.time(),
                status=JobStatus.FAILED,
                error={"code": "interrupted", "message": "interrupted 3 times"},
            )
        )
        await store.close()

    asyncio.run(plant())
    got = _sdk(slow_head).responses.retrieve("resp_lost")
    assert got.status == "failed"
    assert got.error is not None and got.error.code == "interrupted"

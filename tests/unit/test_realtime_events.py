"""Client events decoded into typed structs; each malformed frame is one refusal naming
its field, with the frame's ``event_id`` carried into the ``error`` event."""

from __future__ import annotations

import json
from typing import Any, get_args

import msgspec
import pytest

from omnistage.protocol.errors import BadRequestError
from omnistage.realtime import events as ev


def decode(event: Any) -> ev.AnyClientEvent:
    return ev.decode_client_event(json.dumps(event))


def refusal(frame: str | bytes) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        ev.decode_client_event(frame)
    return info.value


@pytest.mark.parametrize(
    ("event", "kind", "fields"),
    [
        ({"type": "session.update", "session": {"voice": "x"}}, ev.SessionUpdate, {}),
        ({"type": "input_audio_buffer.append", "audio": "AAA="}, ev.AudioAppend, {}),
        ({"type": "input_audio_buffer.commit"}, ev.AudioCommit, {}),
        ({"type": "input_audio_buffer.clear"}, ev.AudioClear, {}),
        (
            {"type": "conversation.item.create", "item": {"type": "message"}},
            ev.ItemCreate,
            {"previous_item_id": None},
        ),
        ({"type": "conversation.item.delete", "item_id": "i"}, ev.ItemDelete, {}),
        ({"type": "conversation.item.retrieve", "item_id": "i"}, ev.ItemRetrieve, {}),
        (
            {"type": "conversation.item.truncate", "item_id": "i", "audio_end_ms": 5},
            ev.ItemTruncate,
            {"content_index": 0},
        ),
        ({"type": "response.create"}, ev.ResponseCreate, {"response": None}),
        (
            {"type": "response.create", "response": {"output_modalities": ["text"]}},
            ev.ResponseCreate,
            {},
        ),
        ({"type": "response.cancel"}, ev.ResponseCancel, {"response_id": None}),
        ({"type": "output_audio_buffer.clear"}, ev.OutputAudioClear, {}),
    ],
)
def test_each_client_event_decodes(
    event: dict[str, Any], kind: type, fields: dict[str, Any]
) -> None:
    got = decode({**event, "event_id": "ev_1"})
    assert type(got) is kind and got.event_id == "ev_1"
    for key, value in {**event, **fields}.items():
        if key != "type":
            assert getattr(got, key) == value


def test_every_event_type_is_listed() -> None:
    assert len(ev.CLIENT_EVENT_TYPES) == 11
    assert "input_audio_buffer.append" in ev.CLIENT_EVENT_TYPES


def test_an_unknown_type_is_refused_with_param_type() -> None:
    err = refusal(json.dumps({"type": "response.start", "event_id": "e9"}))
    assert (err.param, err.code) == ("type", "invalid_value")
    assert "response.start" in str(err) and "response.create" in str(err)
    assert err.event_id == "e9"  # type: ignore[attr-defined]


@pytest.mark.parametrize("event", [{"audio": "AAA="}, {"type": 5}, {"type": None}])
def test_a_missing_or_non_string_type_is_refused_with_param_type(event: dict) -> None:
    assert refusal(json.dumps(event)).param == "type"


@pytest.mark.parametrize(
    ("event", "param"),
    [
        ({"type": "input_audio_buffer.append"}, "audio"),
        ({"type": "input_audio_buffer.append", "audio": 12}, "audio"),
        ({"type": "conversation.item.create"}, "item"),
        ({"type": "conversation.item.create", "item": []}, "item"),
        (
            {"type": "conversation.item.create", "item": {}, "previous_item_id": 1},
            "previous_item_id",
        ),
        ({"type": "conversation.item.truncate", "item_id": "i"}, "audio_end_ms"),
        (
            {"type": "conversation.item.truncate", "item_id": "i", "audio_end_ms": "5"},
            "audio_end_ms",
        ),
        ({"type": "session.update", "session": "x"}, "session"),
        ({"type": "response.cancel", "response_id": 3}, "response_id"),
        ({"type": "input_audio_buffer.commit", "event_id": 7}, "event_id"),
    ],
)
def test_a_missing_or_wrong_field_is_named(event: dict[str, Any], param: str) -> None:
    err = refusal(json.dumps(event))
    assert (err.param, err.code) == (param, "invalid_value")
    assert event["type"] in str(err)


def test_the_event_id_of_a_refused_frame_is_kept() -> None:
    err = refusal(json.dumps({"type": "input_audio_buffer.append", "event_id": "mine"}))
    assert err.event_id == "mine"  # type: ignore[attr-defined]
    fields = msgspec.to_builtins(ev.error_event(err).error)
    assert fields == {
        "type": "invalid_request_error",
        "code": "invalid_value",
        "message": str(err),
        "param": "audio",
        "event_id": "mine",
    }
    # An event id given by the caller (a decoded event refused later) wins.
    assert ev.error_event(err, "other").error.event_id == "other"


@pytest.mark.parametrize("frame", ["{", "not json", b"\xff\xfe", ""])
def test_invalid_json_is_refused(frame: str | bytes) -> None:
    err = refusal(frame)
    assert err.code == "invalid_json" and err.param is None


@pytest.mark.parametrize("frame", ["[]", "3", '"session.update"', "null"])
def test_json_that_is_not_an_object_is_refused(frame: str) -> None:
    err = refusal(frame)
    assert err.code == "invalid_value" and "JSON object" in str(err)
    assert ev.error_event(err).error.event_id is None


def test_bytes_frames_decode_too() -> None:
    assert isinstance(
        ev.decode_client_event(b'{"type": "input_audio_buffer.clear"}'), ev.AudioClear
    )


def test_server_event_ids_are_unique() -> None:
    ids = ev.EventIds()
    assert ids.next() != ids.next()


def test_a_server_event_encodes_as_openai_names_it() -> None:
    event = ev.OutputTextDelta(response_id="resp_1", item_id="item_1", output_index=0, delta="Hi")
    event.event_id = "event_1"
    assert msgspec.json.decode(msgspec.json.encode(event)) == {
        "type": "response.output_text.delta",
        "event_id": "event_1",
        "response_id": "resp_1",
        "item_id": "item_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "Hi",
    }
    error = ev.error_event(BadRequestError("no", param="audio", code="bad"), "mine")
    assert msgspec.json.decode(msgspec.json.encode(error))["error"] == {
        "type": "invalid_request_error",
        "code": "bad",
        "message": "no",
        "param": "audio",
        "event_id": "mine",
    }


def test_every_server_event_type_is_one_the_openai_sdk_parses() -> None:
    realtime = pytest.importorskip("openai.types.realtime")
    (union, *_) = get_args(realtime.RealtimeServerEvent)
    sdk_types = {get_args(c.model_fields["type"].annotation)[0] for c in get_args(union)}
    assert len(set(ev.SERVER_EVENT_TYPES)) == len(ev.SERVER_EVENT_TYPES)
    assert set(ev.SERVER_EVENT_TYPES) <= sdk_types

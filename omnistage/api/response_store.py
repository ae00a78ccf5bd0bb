"""Stored responses: what a Responses API turn keeps, and the conversation a
``previous_response_id`` continues.

A stored turn keeps its own input items (with ids, as ``input_items`` lists them) and
the response object as it was returned. Continuing a turn replays its whole chain,
oldest first: each turn's input, then its output (assistant messages and function
calls read back as input items), then the new input. ``instructions`` are not carried
over, as OpenAI does it. The turns of one chain share ``conversation`` (the first
turn's id): the balancer's affinity key, so a chain goes back to the replica whose
prefix cache holds it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from omnistage.api.ids import next_id
from omnistage.api.schemas.responses import ResponseInputItem, ResponsesRequest
from omnistage.jobs.state import Persistence
from omnistage.protocol.errors import ApiError
from omnistage.store.records import ResponseStatus, StoredResponse

MAX_CHAIN = 1000  # turns one previous_response_id may reach back


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This turn's input items as ``input_items`` lists them (each with an id)."""
    items = []
    for item in body.input:
        data = item.model_dump(exclude_none=True)
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
        data["id"] = f"{prefix.get(item.type, 'item')}_{next_id()}"
        items.append(data)
    return items


def _replayed(stored: StoredResponse) -> list[dict[str, Any]]:
    """A stored turn as input: its input items, then what it answered."""
    out = [dict(i) for i in stored.input_items]
    for item in stored.body.get("output") or []:
        if item.get("type") in ("message", "function_call"):
            out.append(item)
    return out


@dataclass
class Turn:
    """One Responses API request's place in the store."""

    id: str
    owner: str | None
    stored: bool  # whether this turn is kept
    conversation: str
    items: list[dict[str, Any]]  # this turn's input items
    persist: Persistence | None

    @classmethod
    async def of(
        cls, persist: Persistence | None, body: ResponsesRequest, owner: str | None
    ) -> tuple[Turn, ResponsesRequest]:
        """The turn, and the request with the conversation it continues put in front
        of its input (the body itself when it continues none)."""
        rid = f"resp_{next_id()}"
        if persist is None and (body.previous_response_id or body.background):
            field = "previous_response_id" if body.previous_response_id else "background"
            raise ApiError(
                400,
                f"{field} needs a store; this server keeps none",
                "invalid_request_error",
                field,
            )
        turn = cls(rid, owner, body.store and persist is not None, rid, input_items(body), persist)
        if body.previous_response_id is None:
            return turn, body
        assert persist is not None
        chain = await _chain(persist, body.previous_response_id, owner)
        turn.conversation = chain[0].conversation
        history = [
            ResponseInputItem.model_validate(item) for turn_ in chain for item in _replayed(turn_)
        ]
        return turn, body.model_copy(update={"input": history + list(body.input)})

    def record(self, body: dict[str, Any], previous: str | None) -> StoredResponse:
        return StoredResponse(
            id=self.id,
            owner=self.owner,
            created_at=float(body.get("created_at") or time.time()),
            status=ResponseStatus(body.get("status")),
            previous_response_id=previous,
            conversation=self.conversation,
            input_items=self.items,
            body=body,
        )

    async def keep(self, body: dict[str, Any], previous: str | None) -> None:
        if self.stored and self.persist is not None:
            await self.persist.store.put_response(self.record(body, previous))


async def _chain(persist: Persistence, last: str, owner: str | None) -> list[StoredResponse]:
    """The stored turns from the first to ``last``."""
    chain: list[StoredResponse] = []
    rid: str | None = last
    while rid is not None:
        if len(chain) >= MAX_CHAIN:
            raise ApiError(
                400,
                f"the conversation before {last!r} is longer than {MAX_CHAIN} turns",
                "invalid_request_error",
                "previous_response_id",
            )
        stored = await persist.store.get_response(rid, owner)
        if stored is None:
            what = "" if rid == last else f" (reached from {last!r})"
            raise ApiError(
                400,
                f"no stored response {rid!r}{what}",
                "invalid_request_error",
                "previous_response_id",
                "not_found",
            )
        if stored.status.running:
            raise ApiError(
                400,
                f"response {rid!r} is {stored.status}; continue it once it has finished",
                "invalid_request_error",
                "previous_response_id",
            )
        chain.append(stored)
        rid = stored.previous_response_id
    chain.reverse()
    return chain

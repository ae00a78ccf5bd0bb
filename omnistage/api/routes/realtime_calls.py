"""POST /v1/realtime/calls: OpenAI's Realtime API over WebRTC.

The body is the caller's SDP offer, as ``application/sdp``, or a multipart form with the
offer as ``sdp`` and a session config (as a ``session.update``'s) as ``session``; a
``?model=`` names the model as the WebSocket's does, where the session does not. The
answer is ``201`` with the server's SDP answer as ``application/sdp`` and the call's URL in
``Location``; ``POST .../calls/{call_id}/hangup`` ends it. Auth is the API key or an
ephemeral client secret (``api.auth``), whose session config applies first. The session
is the WebSocket's (``routes.realtime.prepare``: the same limits, model and config
checks); ``api.webrtc_call`` runs it over the peer connection. The session is saved and
resumable as the WebSocket's (``api.realtime_resume``): a call made with
``?session_id=sess_...&resume_token=TOKEN`` (our extension) goes on with that session,
whether a call or a WebSocket made it.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from starlette.formparsers import MultiPartException
from starlette.responses import Response

from omnistage.api import realtime_resume as resume
from omnistage.api.body import read_body
from omnistage.api.routes.common import json_response
from omnistage.api.routes.realtime import Refusal, limits_of, load_vad, prepare
from omnistage.api.webrtc_call import RealtimeCall
from omnistage.api.webrtc_media import restrict_host_addresses
from omnistage.protocol.errors import ApiError, BadRequestError
from omnistage.realtime import saved
from omnistage.realtime.config import SessionConfig
from omnistage.store.base import Store
from omnistage.store.records import RealtimeRecord

PATH = "/v1/realtime/calls"
SDP = "application/sdp"
MAX_OFFER_BYTES = 64 * 1024

router = APIRouter()
restrict_host_addresses()


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            SDP: {"schema": {"type": "string"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["sdp"],
                    "properties": {"sdp": {"type": "string"}, "session": {"type": "string"}},
                }
            },
        },
    }
}


@router.post(PATH, status_code=201, openapi_extra=_BODY)
async def create_call(request: Request) -> Response:
    offer, session = await _offer(request)
    limits = limits_of(request)
    minted = request.scope.get("state", {}).get("realtime_session")
    model = (session or {}).get("model") or request.query_params.get("model")
    try:
        ctx, config = prepare(request.app.state.omni, limits, model, minted)
    except Refusal as no:
        raise ApiError(no.status, no.message, "invalid_request_error", no.param, no.code) from None
    limits.live += 1  # before the first await, as the WebSocket's handshake takes it
    try:
        store = resume.store_of(request, limits.resume_ttl_s)
        resumed = await _resumed(request, store, config, session)
        await load_vad(config)
        call = RealtimeCall(ctx, config, resumed[0].id if resumed else None)
    except BaseException:
        limits.live -= 1
        raise
    try:
        if resumed is not None:
            call.session.restore(resumed[0].items)
        call.saver, info = await resume.attach(
            store, request, call.session, resumed, limits.resume_ttl_s, call.lost
        )
        answer = await call.answer(offer, info)
    except Exception as exc:  # aiortc refuses an offer it cannot answer with ValueError etc.
        await call.close()
        limits.live -= 1
        raise _bad(f"the SDP offer cannot be answered: {exc}", "sdp", "invalid_offer") from None
    _keep(request, call)
    headers = {"Location": f"{PATH}/{call.id}"}
    return Response(answer, status_code=201, media_type=SDP, headers=headers)


async def _resumed(
    request: Request, store: Store | None, config: SessionConfig, session: dict[str, Any] | None
) -> tuple[RealtimeRecord, str] | None:
    """The saved session the call resumes (``?session_id=&resume_token=``, as the
    WebSocket's), its config applied, then the form's ``session`` over it; None: a new
    session, with the form's config."""
    try:
        resumed = await resume.load(request, store)
    except resume.ResumeRefused as no:
        raise ApiError(
            no.status, no.message, "invalid_request_error", resume.SESSION_PARAM, no.code
        ) from None
    try:
        if resumed is not None:
            saved.restore_config(config, resumed[0].config)
        if session:
            config.update(session)
    except BadRequestError as exc:
        raise _bad(str(exc), exc.param, exc.code) from None
    return resumed


@router.post(PATH + "/{call_id}/hangup")
async def hang_up(request: Request, call_id: str) -> Response:
    call = _calls(request).get(call_id)
    if call is None:
        raise ApiError(404, f"no call {call_id!r}", "invalid_request_error", "call_id")
    await call.close()
    return json_response({})


def _calls(request: Request) -> dict[str, RealtimeCall]:
    state = request.app.state
    if not hasattr(state, "realtime_calls"):
        state.realtime_calls = {}
    return state.realtime_calls  # type: ignore[no-any-return]


def _keep(request: Request, call: RealtimeCall) -> None:
    """Hold the call until it ends, counted as a live session meanwhile."""
    calls, limits = _calls(request), limits_of(request)
    stats = getattr(request.app.state, "realtime_stats", None)
    calls[call.id] = call
    if stats is not None:
        call.session.ctx.stats = stats
        stats.session_opened()

    def ended(_: Any) -> None:
        calls.pop(call.id, None)
        limits.live -= 1
        if stats is not None:
            stats.session_closed()

    call.closed.add_done_callback(ended)


async def _offer(request: Request) -> tuple[str, dict[str, Any] | None]:
    """The SDP offer and the session config the request gives, if any."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        try:
            form = await request.form()
        except MultiPartException as exc:
            raise _bad(f"the form cannot be read: {exc.message}") from None
        sdp, session = form.get("sdp"), form.get("session")
        if isinstance(sdp, str):
            return _checked(sdp.encode()), _session(session)
        if sdp is not None:
            return _checked(await sdp.read()), _session(session)
        raise _bad("the form has no `sdp` field", "sdp", "missing_required_parameter")
    if kind != SDP:
        raise _bad(f"the body must be {SDP} or multipart/form-data, got {kind or 'none'!r}")
    return _checked(await read_body(request)), None


def _checked(raw: bytes) -> str:
    if len(raw) > MAX_OFFER_BYTES:
        raise _bad(f"the SDP offer is over {MAX_OFFER_BYTES} bytes", "sdp")
    text = raw.decode("utf-8", "replace")
    if not text.startswith("v=0"):
        raise _bad("the body is not an SDP offer (it must start with v=0)", "sdp", "invalid_offer")
    return text


def _session(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        session = json.loads(value if isinstance(value, str) else value.file.read())
    except ValueError:
        raise _bad("`session` is not JSON", "session") from None
    if not isinstance(session, dict):
        raise _bad("`session` must be a JSON object", "session")
    return session

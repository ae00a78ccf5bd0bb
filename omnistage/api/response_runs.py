"""A Responses API request as the pipeline runs it: the prompt its input builds, the
stage params of its settings, and (for background responses and tests) a run to the
final response object without an HTTP client waiting.

The request becomes the prompt /v1/chat/completions would build: ``instructions`` as a
system message first, then ``input``, earlier function calls and their outputs as an
assistant turn's ``tool_calls`` and tool messages.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from omnistage.api.response_audio import AudioPlan, Spoken, heard
from omnistage.api.response_items import Output, ResponseShape
from omnistage.api.routes.common import resolve_stage_params
from omnistage.api.schemas.responses import ResponsesRequest
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ChatMessage, Prompt, ToolCall
from omnistage.protocol.params import NO_PARAMS, ParamKind, SpeechParams, StageParams, decode
from omnistage.service import OutputStream, PipelineService

# The text stage checks its params under their chat names; a 400 names the field the
# client sent.
_PARAM_NAMES = {"response_format": "text.format", "max_tokens": "max_output_tokens"}


def pipeline_request(
    omni: PipelineService,
    body: ResponsesRequest,
    sid: int,
    response_id: str,
    affinity: str,
    audio: AudioPlan | None = None,
    videos: list[bytes] | None = None,
) -> PipelineRequest:
    """The pipeline request answering ``body`` on text stage ``sid`` (and spoken by
    ``audio``'s stage), watching ``videos`` (the files of its last user message's video
    parts); ``affinity``: the conversation, so its turns go where its prefix is cached."""
    try:
        stage_params = resolve_stage_params(omni, body.stage_params)
        if extra := body.chat_params():
            answer = decode(ParamKind.TEXT, extra)
            stage_params[sid] = stage_params.get(sid, NO_PARAMS).merged(answer)
    except BadRequestError as exc:
        raise in_our_terms(exc) from None
    finals = [sid]
    if audio is not None:
        finals.append(audio.stage)
        voice = StageParams(speech=SpeechParams(audio.voice))
        for speaker in omni.graph.speaking_for([audio.stage]):
            stage_params[speaker] = stage_params.get(speaker, NO_PARAMS).merged(voice)
    prompt = Prompt(messages=messages(body), videos=videos or None)
    prompt.audio_in_video = body.audio_in_video() and bool(videos)
    if spoken := heard(omni, body):
        prompt.audio, prompt.audio_format = spoken
    params = body.sampling_params()
    # A stream's status line waits for the audio stage to check the voice (see chat).
    ack = audio is not None and audio.streamed
    return PipelineRequest(
        response_id, prompt, finals, params, stage_params, ack=ack, affinity=affinity
    )


def messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The chat history ``instructions`` and ``input`` describe. The item fields read
    here are those its schema requires of its type."""
    out = [ChatMessage("system", body.instructions)] if body.instructions else []
    for item in body.input:
        if item.type == "message":
            out.append(ChatMessage(str(item.role), item.text()))
        elif item.type == "function_call":
            call = ToolCall(str(item.call_id), str(item.name), str(item.arguments))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":  # one turn: its text, its calls
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage("assistant", "", tool_calls=[call]))
        else:
            out.append(ChatMessage("tool", item.text(), tool_call_id=item.call_id))
    return out


def in_our_terms(exc: BadRequestError) -> BadRequestError:
    if exc.param in _PARAM_NAMES:
        exc.param = _PARAM_NAMES[exc.param]
    return exc


async def run_to_final(
    open_stream: Callable[[PipelineRequest], Awaitable[OutputStream]],
    request: PipelineRequest,
    shape: ResponseShape,
    stage_name: str,
    audio: AudioPlan | None = None,
) -> dict[str, Any]:
    """The final response object (completed, incomplete or failed) of ``request``,
    opened with ``open_stream`` (the service's ``open``, or a patient one)."""
    output = Output(stage_name, Spoken(audio) if audio is not None else None)
    try:
        stream = await open_stream(request)
        try:
            async for out in stream:
                output.add(out)
        finally:
            stream.close()
        output.finish()
    except Exception as exc:
        if isinstance(exc, BadRequestError):
            exc = in_our_terms(exc)
        output.abandon()
        return shape.failed(output, exc)
    return shape.final(output, stream.usage())

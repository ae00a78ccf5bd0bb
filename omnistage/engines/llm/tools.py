"""Function calling for the llm engine: tools in the prompt, calls out of the text.

The model is told about the tools in the Hermes format most open chat models are
trained on (a ``<tools>`` block in the system turn; a call is a JSON object
``{"name": ..., "arguments": {...}}`` inside ``<tool_call>`` tags). A chat template that
knows tools itself gets them through ``apply_chat_template(tools=...)`` instead.

``tool_choice`` decides how free the model is:
- ``none``: the tools are not offered; plain text.
- ``auto``: free text; an answer that starts with ``<tool_call>`` is held back and
  parsed into calls when it ends (it stays text if nothing in it parses).
- ``required``: the output is constrained to one call of one of the tools, arguments
  matching that tool's parameter schema.
- a named function: the output is constrained to that function's arguments, streamed
  as they are written.

``CallShaper`` turns the engine's text deltas into output chunks: text, or
``tool_call`` chunks whose text is a piece of a call's JSON arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from omnistage.engines.base import EngineChunk
from omnistage.engines.llm.guided import dumps
from omnistage.protocol.chunk_meta import ToolCallMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import ChatMessage, TokenLogprob
from omnistage.protocol.params import GenerationParams

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN_TAG) + r"(.*?)(?:" + re.escape(CLOSE_TAG) + r"|$)", re.S)
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True)
class ToolPlan:
    """What a request's ``tools`` and ``tool_choice`` ask of the engine."""

    tools: tuple[Tool, ...] = ()
    mode: str = "none"  # none | auto | required | named
    named: Tool | None = None

    @property
    def offered(self) -> bool:
        return self.mode != "none"

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match (None: free text)."""
        if self.mode == "named" and self.named is not None:
            return self.named.parameters
        if self.mode == "required":
            return {"anyOf": [_call_schema(t) for t in self.tools]}
        return None


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def plan_tools(params: GenerationParams) -> ToolPlan:
    """Validate OpenAI's ``tools`` and ``tool_choice`` params (chat shape)."""
    raw, choice = params.tools, params.tool_choice
    if not raw:
        if choice not in (None, "none", "auto"):
            raise BadRequestError("tool_choice needs tools", "tool_choice")
        return ToolPlan()
    tools: list[Tool] = []
    for i, entry in enumerate(raw):
        fn = entry.get("function") if isinstance(entry, dict) else None
        if (
            not isinstance(entry, dict)
            or entry.get("type", "function") != "function"
            or not (isinstance(fn, dict))
        ):
            raise BadRequestError(f"tools[{i}] must be a function tool", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise BadRequestError(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -", "tools"
            )
        parameters = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise BadRequestError(f"tools[{i}].function.parameters must be an object", "tools")
        description = fn.get("description") or ""
        tools.append(Tool(name, str(description), parameters))
    if len({t.name for t in tools}) != len(tools):
        raise BadRequestError("tools: function names must be unique", "tools")
    if choice is None or choice in ("auto", "none", "required"):
        return ToolPlan(tuple(tools), choice or "auto")
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    named = next((t for t in tools if t.name == name), None)
    if named is None:
        raise BadRequestError(
            "tool_choice must be none, auto, required or "
            '{"type": "function", "function": {"name": <one of tools>}}',
            "tool_choice",
        )
    return ToolPlan(tuple(tools), "named", named)


def chat_messages(
    messages: list[ChatMessage], plan: ToolPlan, template_knows_tools: bool
) -> list[dict[str, Any]]:
    """The messages for the chat template, with tools and earlier calls rendered."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if template_knows_tools:
            out.append(_native(m))
        elif m.role == "tool":
            answer = f"<tool_response>\n{m.content}\n</tool_response>"
            out.append({"role": "user", "content": answer})
        elif m.tool_calls:
            calls = "\n".join(
                f"{OPEN_TAG}\n{dumps({'name': c.name, 'arguments': _loads(c.arguments)})}\n"
                f"{CLOSE_TAG}"
                for c in m.tool_calls
            )
            out.append({"role": m.role, "content": (m.content + "\n" + calls).lstrip()})
        else:
            out.append({"role": m.role, "content": m.content})
    if plan.offered and not template_knows_tools:
        system = _system_text(plan)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _native(m: ChatMessage) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        entry["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _loads(c.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        entry["tool_call_id"] = m.tool_call_id
    return entry


def _system_text(plan: ToolPlan) -> str:
    specs = "\n".join(dumps(t.spec()) for t in plan.tools)
    return (
        "You may call one or more functions to help with the user's request. The "
        f"functions are described within <tools></tools> XML tags:\n<tools>\n{specs}\n"
        "</tools>\nTo call a function, answer with a JSON object holding its name and "
        f"arguments within {OPEN_TAG}{CLOSE_TAG} XML tags:\n{OPEN_TAG}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE_TAG
    )


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


@dataclass
class CallShaper:
    """One request's output: text deltas in, text or tool-call chunks out (pure)."""

    plan: ToolPlan
    # The text the client already has (a retry): in auto mode it was text, not a call.
    resumed: str = ""
    _held: str = ""
    _held_logprobs: list[TokenLogprob] = field(default_factory=list)
    _holding: bool = False
    _text_started: bool = False

    def __post_init__(self) -> None:
        self._text_started = bool(self.resumed) and self.plan.mode == "auto"
        self._holding = self.plan.mode in ("auto", "required") and not self._text_started

    def shape(self, chunk: EngineChunk) -> list[EngineChunk]:
        mode = self.plan.mode
        if mode == "named":
            return [self._call_piece(chunk)]
        if not self._holding:
            return [chunk]
        self._held += chunk.text
        if chunk.logprobs:
            self._held_logprobs += chunk.logprobs
        if mode == "auto" and not self._maybe_call(self._held):
            self._holding, self._text_started = False, True
            chunk.text, self._held = self._held, ""
            chunk.logprobs = self._take_logprobs()
            return [chunk]
        if not chunk.finished:
            return []
        return self._calls(chunk)

    def _take_logprobs(self) -> list[TokenLogprob] | None:
        taken, self._held_logprobs = self._held_logprobs, []
        return taken or None

    def _call_piece(self, chunk: EngineChunk) -> EngineChunk:
        assert self.plan.named is not None
        chunk.modality = Modality.TOOL_CALL
        chunk.meta = ToolCallMeta(0, self.plan.named.name)
        if chunk.finished and chunk.finish_reason == FinishReason.STOP:
            chunk.finish_reason = FinishReason.TOOL_CALLS
        return chunk

    @staticmethod
    def _maybe_call(held: str) -> bool:
        head = held.lstrip()
        return head.startswith(OPEN_TAG) or OPEN_TAG.startswith(head)

    def _calls(self, last: EngineChunk) -> list[EngineChunk]:
        text, self._held = self._held, ""
        found = self._parse(text)
        logprobs = self._take_logprobs()
        if not found:  # nothing parses: the model wrote text after all
            last.text, last.logprobs = text, logprobs
            return [last]
        out = []
        for i, (name, arguments) in enumerate(found):
            chunk = EngineChunk(Modality.TOOL_CALL, text=arguments, meta=ToolCallMeta(i, name))
            out.append(chunk)
        out[-1].finished = True
        if last.finish_reason == FinishReason.STOP:
            out[-1].finish_reason = FinishReason.TOOL_CALLS
        else:
            out[-1].finish_reason = last.finish_reason
        out[-1].usage, out[-1].logprobs = last.usage, logprobs
        return out

    def _parse(self, text: str) -> list[tuple[str, str]]:
        bodies = [text] if self.plan.mode == "required" else _CALL.findall(text)
        names = {t.name for t in self.plan.tools}
        found = []
        for body in bodies:
            try:
                call = json.loads(body)
            except ValueError:
                continue
            if not isinstance(call, dict) or call.get("name") not in names:
                continue
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):  # some models write the arguments as a string
                arguments = _loads(arguments)
            found.append((call["name"], dumps(arguments)))
        return found

"""The ``llm`` engine's input step: an engine request in, one typed ``LlmRequest`` out.

Everything that can reject a request happens here, before the step loop sees it: the
sampling settings, the tool plan and its grammar, the context window. What comes out is
ready to submit: the prompt's token ids through the chat template, the state a retry
resumes from, and how many tokens this run may still generate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from omnistage.config.engine_args import LlmArgs
from omnistage.engines.base import EngineRequest, StageInput
from omnistage.engines.llm.guided import (
    Guide,
    TokenVocabulary,
    json_grammar,
    schema_of_response_format,
)
from omnistage.engines.llm.model_defaults import under_model
from omnistage.engines.llm.prefix_labels import (
    rendered_turns,
    template_default_turns,
    turn_labels,
)
from omnistage.engines.llm.prompts import chat_ids, with_heard, with_system
from omnistage.engines.llm.sampling import SamplingParams
from omnistage.engines.llm.tools import ToolPlan, chat_messages, plan_tools
from omnistage.engines.llm.truncation import context_length_error, truncate_prompt
from omnistage.protocol.enums import Modality
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import ChatMessage, Prompt
from omnistage.protocol.params import GenerationParams
from omnistage.protocol.prefix import prefix_keys


@dataclass(frozen=True)
class Resume:
    """Where a retry after a replica failure goes on from: the text the client already
    has, re-encoded (byte-level BPE gives back the same tokens in practice)."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    # Counted against max_tokens as the failed replica counted them: under a grammar it
    # may have written the text in more tokens than re-encoding gives.
    tokens: int = 0


@dataclass(frozen=True)
class LlmRequest:
    """One request as the step loop runs it."""

    request_id: str
    # The prompt through the chat template, without a resumed continuation.
    prompt_ids: list[int]
    resume: Resume
    sampling: SamplingParams
    plan: ToolPlan
    guide: Guide | None
    # Tokens this run may generate: what max_tokens leaves after the resumed ones,
    # within the context window.
    max_tokens: int
    # Prompt prefix end -> the prefix key of the client's messages it holds.
    prefix_labels: dict[int, int]
    # The prefix key of the messages plus this answer (see InputProcessor.answer_key).
    answer_key: Callable[[str], int] | None

    @property
    def ids(self) -> list[int]:
        """What the model reads: the prompt, then the resumed continuation."""
        return self.prompt_ids + self.resume.ids

    @property
    def already_done(self) -> bool:
        """The failed replica had generated everything but the final message."""
        return bool(self.resume.ids) and self.resume.tokens >= self.sampling.max_tokens


async def upstream_text(inputs: AsyncIterator[StageInput]) -> str:
    """Upstream text (a listener's transcript, another model's answer); none for a
    source stage, whose inputs end at once."""
    return "".join([i.text async for i in inputs if i.modality == Modality.TEXT])


class InputProcessor:
    """The loaded model's tokenizer and limits, applied to requests (no weights needed)."""

    def __init__(
        self,
        args: LlmArgs,
        tokenizer: Any,
        vocabulary: TokenVocabulary,
        window: int,
        eos_ids: list[int],
        label_prefixes: bool,
        model_sampling: GenerationParams | None = None,
    ) -> None:
        self.args = args
        # The model's own sampling defaults, under everything the request brings.
        self.model_sampling = model_sampling or GenerationParams()
        self.tokenizer = tokenizer
        self.vocabulary = vocabulary
        self.window = window
        self._vocab = vocabulary.vocab_size
        template = getattr(tokenizer, "chat_template", "") or ""
        self._template_knows_tools = "tools" in template
        # Turns the chat template adds before messages (None: prompts are not labelled
        # with prefix keys; see prefix_labels).
        self._default_turns: int | None = None
        if label_prefixes and template:
            self._default_turns = template_default_turns(self.render, frozenset(eos_ids))
        self._turn_ends = frozenset(eos_ids)

    def process(self, request: EngineRequest, heard: str) -> LlmRequest:
        """The typed request; BadRequestError if it cannot run."""
        client = with_heard(request.prompt, heard)
        prompt = client
        if self.args.system_prompt:
            prompt = with_system(prompt, self.args.system_prompt)
        params = request.params.generation
        sampling, plan, guide = self.setup(params)
        open_end = bool(params.continue_final_message)
        resume = self._resume(request.resume_text, request.resume_tokens)
        dropped = 0
        if params.truncation == "auto":
            prompt, dropped = truncate_prompt(
                prompt,
                lambda trial: len(self._prompt_ids(trial, plan, open_end)[0]),
                self.window,
                sampling.max_tokens + len(resume.ids),
            )
        ids, turns = self._prompt_ids(prompt, plan, open_end)
        if guide is not None:
            guide.replay(resume.ids)
        room = self.window - len(ids) - len(resume.ids)
        if room < 1:
            raise context_length_error(self.window, len(ids) + len(resume.ids))
        # A truncated conversation is no longer the one whose prefixes the head keyed.
        labels = {} if dropped else self._prefix_labels(ids, client, turns)
        # The answer's key needs the whole answer as the content the client sends back:
        # not so after a resume (this run writes the rest) or with tools (calls go back
        # as tool_calls).
        labelled = labels and not resume.ids and not plan.offered
        return LlmRequest(
            request_id=request.request_id,
            prompt_ids=ids,
            resume=resume,
            sampling=sampling,
            plan=plan,
            guide=guide,
            max_tokens=min(sampling.max_tokens - resume.tokens, room),
            prefix_labels=labels,
            answer_key=answer_key(client) if labelled else None,
        )

    def setup(self, params: GenerationParams) -> tuple[SamplingParams, ToolPlan, Guide | None]:
        """A request's sampling params, tool plan and grammar; BadRequestError if any
        of them is wrong."""
        params = under_model(self.model_sampling, params)
        sampling = SamplingParams.from_params(params, self.args.default_max_tokens)
        for token, _ in sampling.logit_bias:
            if token >= self._vocab:
                raise BadRequestError(f"logit_bias: no token {token}", "logit_bias")
        plan = plan_tools(params)
        schema, param = plan.schema(), "tools"
        if schema is None:
            schema, param = schema_of_response_format(params.response_format), "response_format"
        guide = None
        if schema is not None:
            guide = Guide(self.vocabulary, json_grammar(schema, param), param)
        return sampling, plan, guide

    def _resume(self, text: str, tokens: int) -> Resume:
        if not text:
            return Resume()
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return Resume(text, ids, max(tokens, len(ids)) if ids else 0)

    def _prompt_ids(
        self, prompt: Prompt, plan: ToolPlan, open_end: bool = False
    ) -> tuple[list[int], int]:
        """The prompt's token ids, and the turns its chat template rendered (-1: none).
        ``open_end``: the last message is left open (``continue_final_message``); its
        turn is not a prefix a later request shares."""
        if prompt.messages is None:
            return list(self.tokenizer.encode(prompt.text or "")), -1
        messages = chat_messages(prompt.messages, plan, self._template_knows_tools)
        extra: dict[str, Any] = {}
        if plan.offered and self._template_knows_tools:
            extra["tools"] = [t.spec() for t in plan.tools]
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        turns = rendered_turns(messages, self._default_turns or 0) if templated else -1
        return self.render(messages, open_end, **extra), -1 if open_end else turns

    def render(
        self, messages: list[dict[str, Any]], open_end: bool = False, **extra: Any
    ) -> list[int]:
        return chat_ids(self.tokenizer, messages, open_end, **extra)

    def _prefix_labels(self, ids: list[int], client: Prompt, turns: int) -> dict[int, int]:
        """Prefix end -> the prefix key of the client's messages it holds (the keys the
        head computes; turns the engine added come first and hold none of them)."""
        messages = client.messages
        if self._default_turns is None or not messages or turns < 0:
            return {}
        keys = prefix_keys(messages)
        return turn_labels(ids, self._turn_ends, keys, turns - len(messages))


def answer_key(client: Prompt) -> Callable[[str], int]:
    """The prefix key a conversation's next request gives its messages up to this
    answer: the client sends the answer back as an assistant message's content."""
    messages = list(client.messages or ())

    def key(text: str) -> int:
        return prefix_keys([*messages, ChatMessage("assistant", text)])[-1]

    return key

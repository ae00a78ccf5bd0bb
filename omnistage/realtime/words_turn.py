"""Whether a user's words so far end their turn, as the thinker's language model reads them.

Smart Turn (``semantic_vad``) hears *how* the words were said; many finished questions
it calls only likely finished (0.5 to the eagerness's threshold), and such a turn waits
``Eager.unsure_wait_ms`` (a second at "auto") before it is answered. The words settle
most of those: "what is the capital of france" is finished, "what is the best way" is
not, whatever the voice did. LiveKit's turn detector asks a small language model the
same question; here the thinker itself is asked (the one model every voice pipeline
has, already loaded and warm): the user's words are left open as the last message
(``continue_final_message``), and the probability that the next token ends the sentence
(".", "?" or "!" among its ``top_logprobs``) is the words' verdict.

The words are Whisper's, whose punctuation says little (it punctuates fragments too):
they are read without it, lowercased. On the default SmolLM2-135M with the voice
pipeline's system prompt, of typed words, 28 of 30 finished requests score >= 0.1 and 23
of 24 sentences cut at a word boundary score below 0.05 (the one above is itself a sentence: "I need
to buy some milk"); see ``semantic_vad.WORDS_END`` for how the two verdicts combine.

When the assistant's last words (the conversation's last message) ask a question, the
user's words are read as the reply: "london please" ends a turn after "Which city?" far
more surely than alone (0.51 against 0.12 on the default thinker), while a fragment ("for
the city of") stays near 0 either way. Only a question is shown: after a statement
("The capital of France is Paris.") a new question scored lower than alone (6 of the
bench's 8 finished questions at >= 0.4 alone, 4-5 of 8 after one of three statements).
And only its end (``SAID_CHARS``: a question is asked last), so the prompt stays short.

A thinker that cannot say (another engine refusing the request, a stage failing) gives
no verdict, and the turn waits as it would without words; after one refusal it is not
asked again.
"""

from __future__ import annotations

import logging
import math
import re

from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ChatMessage, Prompt, TokenLogprob
from omnistage.protocol.params import GenerationParams, StageParams
from omnistage.realtime.conversation import new_id
from omnistage.service import PipelineService

log = logging.getLogger(__name__)

# Tokens that end a sentence (as the model writes them, spaces aside).
END_MARKS = frozenset({".", "?", "!"})
# Alternatives asked for: an end mark likely enough to matter is among them.
TOP = 20
_NOT_SAID = re.compile(r"[^\w\s']")
# How much of the assistant's last words the thinker is shown: their end, a few
# sentences' worth.
SAID_CHARS = 240


def normalized(words: str) -> str:
    """The words as the model is asked them: no punctuation, lowercase, single spaces."""
    return " ".join(_NOT_SAID.sub(" ", words).lower().split())


def said_tail(said: str) -> str:
    """The end of the assistant's last words, cut at a word boundary, at most
    ``SAID_CHARS`` long."""
    said = " ".join(said.split())
    if len(said) <= SAID_CHARS:
        return said
    tail = said[-SAID_CHARS:]
    return tail.split(" ", 1)[1] if " " in tail else tail


def asked_messages(words: str, said: str = "") -> list[ChatMessage]:
    """What the thinker is shown (its open last message: the user's ``words``), after
    ``said`` if it asks a question; [] when there are no words."""
    text = normalized(words)
    if not text:
        return []
    asked = said.rstrip().endswith("?")  # a reply to a question, not a new turn
    before = [ChatMessage("assistant", said_tail(said))] if asked else []
    return [*before, ChatMessage("user", text)]


def end_probability(entry: TokenLogprob) -> float:
    """The probability that the token after the words ends the sentence."""
    return sum(math.exp(t.logprob) for t in entry.top_logprobs if t.token.strip() in END_MARKS)


class WordsJudge:
    """Asks the thinker stage whether words end a turn (see the module's docstring)."""

    def __init__(self, service: PipelineService, thinker: int) -> None:
        self._service = service
        self._thinker = thinker
        self._refused = False  # the thinker cannot say: not asked again

    async def __call__(self, words: str, said: str = "") -> float | None:
        """The probability that ``words`` end the user's turn (None: no verdict); ``said``:
        the assistant's words before them ("" when there are none), shown if a question."""
        messages = asked_messages(words, said)
        if not messages or self._refused:
            return None
        params = GenerationParams(
            max_tokens=1,
            temperature=0.0,
            logprobs=True,
            top_logprobs=TOP,
            continue_final_message=True,
        )
        request = PipelineRequest(
            f"realtime-words-{new_id('w')}",
            Prompt(messages=messages),
            [self._thinker],
            stage_params={self._thinker: StageParams(text=params)},
            only=True,
        )
        try:
            stream = await self._service.open(request)
            try:
                async for out in stream:
                    if out.logprobs:
                        return end_probability(out.logprobs[0])
            finally:
                stream.close()
        except BadRequestError as exc:
            self._refused = True
            log.info("the thinker cannot judge a turn's words (%s): Smart Turn alone", exc)
            return None
        except Exception as exc:  # a stage failing: this turn waits as without words
            log.debug("no verdict on a turn's words: %s", exc)
            return None
        self._refused = True  # it answered without logprobs
        log.info("the thinker gives no logprobs: a turn's words are not judged")
        return None

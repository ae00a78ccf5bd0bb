"""Whether speech over an answer is a backchannel (or a noise) or a request.

When the user starts to speak during an answer, its audio pauses at once
(``output_hold``); what the speech was decides what comes next:

- A backchannel ("uh-huh", "yeah", "okay", "I see": a few words, each a listener's
  acknowledgement) or a noise (no words) resumes the answer where it paused.
- Anything else is a request: the answer is cancelled and the new turn answered.
- Speech that goes on past ``max_speech_ms`` is a request without waiting for its words:
  nobody says "mm-hmm" for that long.

The speech is judged at its first pause (``user_turn.PAUSE_MS``) from the words said so
far, and again if the user goes on after it. Where nobody transcribes (an omni thinker
hears the audio itself), short speech is taken for a backchannel. Times are the user
audio's own (ms into the turn), so the decision is the same however fast it arrives.

Waiting for the words is what takes time: the phrase is transcribed after the pause, by
a listener that shares the machine with the answer's thinker and talker (0.8-2.3 s on
the project's 2-core VM). So speech short enough to be a backchannel
(``quick_ms``) does not wait for them once its silence has lasted ``words_wait_ms`` past
the pause (of the user's audio, not the server's clock: a comma's pause in a longer
request is over before that, and a server that falls behind the audio does not resume
early): the answer resumes then, provisionally, and its words still decide: if they turn
out to be a request, the answer is cancelled when they come (a short "stop" lets the
answer play on until it is heard).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

# Said alone, or a few together ("yeah yeah", "okay, right"): words that acknowledge.
_WORDS = frozenset(
    [
        "uh",
        "huh",
        "mm",
        "hmm",
        "mhm",
        "hm",
        "um",
        "ah",
        "oh",
        "yeah",
        "yes",
        "yep",
        "yup",
        "ya",
        "okay",
        "ok",
        "kay",
        "right",
        "sure",
        "alright",
    ]
)
_PHRASES = ("i see", "all right", "got it")
_MAX_WORDS = 4  # more than this is saying something


def is_backchannel(transcript: str) -> bool:
    """Whether ``transcript`` says nothing but acknowledgements (or nothing at all)."""
    text = " " + re.sub(r"[^a-z]+", " ", transcript.lower()).strip() + " "
    if len(text.split()) > _MAX_WORDS:
        return False
    for phrase in _PHRASES:
        text = text.replace(f" {phrase} ", "  ")
    return all(word in _WORDS for word in text.split())


class Decision(enum.StrEnum):
    WAIT = "wait"  # not known yet: the answer stays paused
    RESUME = "resume"
    CANCEL = "cancel"


@dataclass(frozen=True, slots=True)
class BackchannelPolicy:
    """What speech over an answer means, from how long it has gone on and its words.

    ``max_speech_ms`` counts the turn's audio from its start, which is the VAD's prefix
    padding (300 ms by default) before the speech, so a backchannel of up to about a
    second of speech fits in the default."""

    max_speech_ms: float = 1500
    # Speech up to this long (the turn's audio at its pause: the prefix padding, about
    # 0.7 s of voice, the pause) may resume before its words are heard ...
    quick_ms: float = 1100
    # ... once its silence has gone on this much longer than the pause (``PAUSE_MS``, 120
    # ms): 370 ms of silence in all, longer than the pause between two words of a request
    # ("Wait, ... stop").
    words_wait_ms: float = 250

    def may_resume_unheard(self, speech_ms: float) -> bool:
        """Whether speech of ``speech_ms`` resumes the answer if its words are slow."""
        return speech_ms <= self.quick_ms

    def speaking(self, speech_ms: float) -> Decision:
        """The user is still speaking, ``speech_ms`` into the turn."""
        return Decision.CANCEL if speech_ms > self.max_speech_ms else Decision.WAIT

    def heard(self, speech_ms: float, transcript: str | None) -> Decision:
        """The user paused or stopped after ``speech_ms`` and said ``transcript`` (None:
        nobody transcribes here)."""
        if speech_ms > self.max_speech_ms:
            return Decision.CANCEL
        if transcript is None or is_backchannel(transcript):
            return Decision.RESUME
        return Decision.CANCEL

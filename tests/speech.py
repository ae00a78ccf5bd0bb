"""Checking what the listener heard against what a test said.

The tests' questions are said by the pipeline's own Piper voice, whose synthesis is
random (VITS draws noise each time), and Whisper tiny.en hears a rare take of "What is
the capital of France?" as "... capital of friends?". A test that checks the words
allows one of them to be misheard: enough to show the question was transcribed, not
a check of Whisper's accuracy.
"""

from __future__ import annotations

import re


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def heard_as(transcript: str, said: str, misheard: int = 1) -> bool:
    """True if ``transcript`` has all of ``said``'s words but at most ``misheard``."""
    expected = words(said)
    return len(expected - words(transcript)) <= misheard

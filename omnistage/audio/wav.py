"""Small pure helpers for audio engines: WAV headers, PCM durations, sentence splitting.

No third-party imports: the API layer can use these without loading an engine.
"""

from __future__ import annotations

import re
import struct

# The RIFF and data sizes a streaming header carries: the length is not known yet.
_UNKNOWN_SIZE = 0xFFFFFFFF

# A sentence ends at . ! ? (possibly repeated, possibly closed by quotes or brackets)
# followed by whitespace, or at a newline. A terminator at the very end of the buffer
# does not count yet: "3." may still become "3.14".
_TERMINATOR = re.compile(r"[.!?]+[\"'\u201d\u2019\u00bb)\]]*(?=\s)|\n")

# Words whose trailing "." is not a sentence end (lower case, without the dot).
_ABBREVIATIONS = frozenset(
    {
        "mr",
        "mrs",
        "ms",
        "mx",
        "dr",
        "prof",
        "sr",
        "jr",
        "st",
        "mt",
        "ft",
        "vs",
        "cf",
        "approx",
        "fig",
        "vol",
        "inc",
        "ltd",
        "co",
        "corp",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
    }
)
# Dotted initialisms such as "e.g." "i.e." "a.m." "U.S.".
_DOTTED = re.compile(r"(?:[A-Za-z]\.){2,}")


def wav_header(
    sample_rate: int, num_channels: int = 1, bits: int = 16, data_bytes: int | None = None
) -> bytes:
    """A 44-byte PCM WAV header; ``data_bytes=None`` gives a streaming header.

    A streaming header carries 0xFFFFFFFF as the RIFF and data sizes, which players
    read as "until the end of the stream".
    """
    if sample_rate <= 0 or num_channels <= 0 or bits <= 0 or bits % 8:
        raise ValueError(f"bad WAV format: {sample_rate} Hz, {num_channels} channels, {bits} bits")
    block_align = num_channels * bits // 8
    byte_rate = sample_rate * block_align
    if data_bytes is None:
        riff_size = data_size = _UNKNOWN_SIZE
    else:
        if data_bytes < 0 or data_bytes > _UNKNOWN_SIZE - 36:
            raise ValueError(f"WAV data size {data_bytes} out of range")
        riff_size, data_size = 36 + data_bytes, data_bytes
    return (
        struct.pack("<4sI4s", b"RIFF", riff_size, b"WAVE")
        + struct.pack(
            "<4sIHHIIHH", b"fmt ", 16, 1, num_channels, sample_rate, byte_rate, block_align, bits
        )
        + struct.pack("<4sI", b"data", data_size)
    )


def wav_bytes(pcm16: bytes, sample_rate: int) -> bytes:
    """A complete mono 16-bit WAV file holding ``pcm16`` (little-endian samples)."""
    if len(pcm16) % 2:
        raise ValueError(f"16-bit PCM must have an even byte count, got {len(pcm16)}")
    return wav_header(sample_rate, 1, 16, len(pcm16)) + pcm16


def pcm_duration_s(pcm16: bytes, sample_rate: int, num_channels: int = 1) -> float:
    """Seconds of audio in 16-bit PCM bytes."""
    if sample_rate <= 0:
        raise ValueError(f"bad sample rate {sample_rate}")
    return len(pcm16) / (2 * num_channels * sample_rate)


# An unpunctuated run longer than this is spoken in pieces anyway (cut after a comma,
# else after a space) so audio never waits for a whole punctuation-free answer.
MAX_PIECE_CHARS = 240


def split_sentences(buffer: str, max_chars: int = MAX_PIECE_CHARS) -> tuple[list[str], str]:
    """Complete sentences at the start of ``buffer``, and the unfinished rest.

    A sentence is complete when its terminator (. ! ? or a newline) is followed by
    whitespace, so text that is still streaming in never splits early. Abbreviations
    ("Mr." "Dr." "e.g.") do not end a sentence. Sentences come back stripped; empty
    ones are skipped. The rest keeps its trailing whitespace (the next piece of text
    may start a new word) but loses its leading whitespace.
    """
    sentences: list[str] = []
    start = 0
    for match in _TERMINATOR.finditer(buffer):
        end = match.end()
        if match.group() != "\n" and _is_abbreviation(buffer, start, match.start()):
            continue
        sentence = buffer[start:end].strip()
        if sentence:
            sentences.append(sentence)
        start = end
    rest = buffer[start:].lstrip()
    while len(rest) > max_chars:
        window = rest[:max_chars]
        cut = window.rfind(", ") + 1 or window.rfind(" ")
        if cut <= 0:
            cut = max_chars
        sentences.append(rest[:cut].strip())
        rest = rest[cut:].lstrip()
    return sentences, rest


def _is_abbreviation(buffer: str, start: int, dot: int) -> bool:
    """Whether the terminator at ``dot`` closes an abbreviation rather than a sentence."""
    if buffer[dot] != ".":
        return False
    if buffer.startswith("..", dot):
        return False  # an ellipsis ends a sentence
    word_start = dot
    while word_start > start and not buffer[word_start - 1].isspace():
        word_start -= 1
    word = buffer[word_start : dot + 1].lstrip("\"'(\u201c\u2018[")
    if _DOTTED.fullmatch(word):
        return True
    if len(word) == 2 and word[0].isupper() and word[0] != "I":
        return True  # an initial, as in "J. Smith"
    return word[:-1].lower() in _ABBREVIATIONS


# Where a first clause may end: a comma, semicolon or colon followed by whitespace.
_CLAUSE_END = re.compile(r"[,;:](?=\s)")


def split_first_clause(buffer: str, min_words: int = 4) -> tuple[str | None, str]:
    """The first clause of ``buffer`` if it is complete and at least ``min_words`` long.

    Speaking the opening clause before its sentence is finished cuts time to first
    audio: the listener hears the start while the rest is still being written.
    """
    for match in _CLAUSE_END.finditer(buffer):
        clause = buffer[: match.end()].strip()
        if len(clause.split()) >= min_words:
            return clause, buffer[match.end() :].lstrip()
    return None, buffer


# Words a spoken phrase boundary comes before: a verb after its subject ("The capital of
# France | is Paris"), a conjunction or a relative pronoun. Cutting there keeps each
# part a natural unit of speech.
# fmt: off
_PHRASE_BREAKS = frozenset({
    "is", "are", "was", "were", "has", "have", "had", "will", "can", "could", "would",
    "should", "may", "might", "must", "and", "but", "or", "because", "so", "which", "that",
    "who", "whose", "when", "where", "while", "with", "for",
})
# fmt: on
_WORD = re.compile(r"\S+")


def split_first_phrase(buffer: str, min_words: int = 3) -> tuple[str | None, str]:
    """The opening of ``buffer`` worth speaking before its sentence is finished: its
    first clause (``split_first_clause``), else the words before the first phrase
    boundary with at least ``min_words`` words before it since any clause mark. The
    first audio of an answer then waits for a few words, not a sentence.

    The boundary word may still be being written: "is" may go on to "isn't" or, rarely
    (a tokenizer writes common words whole), "island". The cut is made as soon as the
    boundary word appears, since the words before it are complete either way and a cut
    before an unfinished word is still a cut between words; waiting for the word to end
    cost a decode step on every answer's first audio."""
    clause, rest = split_first_clause(buffer)
    if clause is not None:
        return clause, rest
    run = 0  # words since the last clause mark: "Hello there, this | is" is no phrase
    for word in _WORD.finditer(buffer):
        text = word.group()
        if run >= min_words and text.lower() in _PHRASE_BREAKS:
            return buffer[: word.start()].strip(), buffer[word.start() :]
        run = 0 if text[-1] in ",;:" else run + 1
    return None, buffer

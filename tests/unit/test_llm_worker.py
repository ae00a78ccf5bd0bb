"""The LLM step loop on a fake ``Batch`` (no model weights): admission within the row
and KV limits, one decode step for every running row, aborts, finishing and failures.

The fake model counts: after token t comes t + 1, and EOS after the last letter, so
each sequence's output is known from its prompt. Its tokens decode to letters."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import pytest
import torch

from omnistage.engines.base import EngineChunk
from omnistage.engines.llm import stream_pace
from omnistage.engines.llm.detok import Detokenizer
from omnistage.engines.llm.sampling import Sampler, SamplingParams
from omnistage.engines.llm.stream_pace import StreamPace
from omnistage.engines.llm.worker import Batch, BatchLimits, LlmWorker, Sequence
from omnistage.engines.torch_threads import TorchThread
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.messages import TokenLogprob, Usage

EOS = 15
VOCAB = 16
ROOMY = BatchLimits(max_num_seqs=8, max_kv_tokens=10_000, max_model_len=1_000)


def _rows(n: int) -> BatchLimits:
    return BatchLimits(max_num_seqs=n, max_kv_tokens=10_000, max_model_len=1_000)


def _next(token: int) -> torch.Tensor:
    logits = torch.zeros(VOCAB)
    logits[min(token + 1, EOS)] = 1.0
    return logits


class CountingBatch:
    """A ``Batch`` whose model continues counting, recording what the worker asks."""

    def __init__(self, cached: int = 0) -> None:
        self.prefill_cached = 0
        self.prefixes = None
        self._cached = cached  # prompt positions each prefill "finds" in a prefix cache
        self.positions: list[int] = []
        self._last: list[int] = []
        self._staged: int | None = None
        # (prompt, replay, rows running when it came): the admissions, in order.
        self.prefills: list[tuple[list[int], int, int]] = []
        self.kept: list[list[int]] = []
        # (ids, label, the row's cached length then): the answers it was asked to keep.
        self.remembered: list[tuple[list[int], int | None, int]] = []
        self.labels: list[dict[int, int]] = []  # each prefill's prefix labels
        self.widest = 0  # the most rows one decode step served
        self.resets = 0
        self.fail_decodes = 0

    @property
    def rows(self) -> int:
        return len(self.positions)

    def prefill(
        self, ids: list[int], replay: int = 0, labels: Mapping[int, int] | None = None
    ) -> torch.Tensor:
        self.prefills.append((list(ids), replay, self.rows))
        self.labels.append(dict(labels or {}))
        self.prefill_cached = min(self._cached, len(ids))
        self._staged = len(ids)
        return _next(ids[-1])

    def admit(self, first_token: int) -> None:
        assert self._staged is not None
        self.positions.append(self._staged)
        self._last.append(first_token)
        self._staged = None

    def decode(self) -> torch.Tensor:
        if self.fail_decodes:
            self.fail_decodes -= 1
            raise RuntimeError("the model broke")
        self.widest = max(self.widest, self.rows)
        return torch.stack([_next(t) for t in self._last])

    def advance(self, tokens: list[int]) -> None:
        self._last = list(tokens)
        self.positions = [p + 1 for p in self.positions]

    def remember(self, row: int, ids: list[int], label: int | None = None) -> None:
        self.remembered.append((list(ids), label, self.positions[row]))

    def keep(self, rows: list[int]) -> None:
        self.kept.append(list(rows))
        self.positions = [self.positions[i] for i in rows]
        self._last = [self._last[i] for i in rows]

    def reset(self) -> None:
        self.resets += 1
        self.positions, self._last, self._staged = [], [], None


class Letters:
    """A tokenizer: token i is the i-th letter."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class Outputs:
    """What one sequence was delivered, and when it ended."""

    def __init__(self) -> None:
        self.chunks: list[EngineChunk] = []
        self.error: BaseException | None = None
        self.ended = threading.Event()

    def __call__(self, item: EngineChunk | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = item
            self.ended.set()
            return
        self.chunks.append(item)
        if item.finished:
            self.ended.set()

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def last(self) -> EngineChunk:
        return self.chunks[-1]


def _seq(rid: str, prompt: list[int], max_tokens: int = 100, **kw: object) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    sampler = Sampler(params, VOCAB, torch.device("cpu"), eos_ids=frozenset({EOS}))
    return Sequence(
        request_id=rid,
        prompt_ids=prompt,
        sampler=sampler,
        max_tokens=max_tokens,
        detok=Detokenizer(Letters()),
        deliver=Outputs(),
        **kw,  # type: ignore[arg-type]
    )


def _out(seq: Sequence) -> Outputs:
    assert isinstance(seq.deliver, Outputs)
    return seq.deliver


def _wait(*seqs: Sequence) -> None:
    for seq in seqs:
        assert _out(seq).ended.wait(10), f"{seq.request_id} never ended"


@pytest.fixture
def thread() -> TorchThread:
    return TorchThread("test-llm-worker")


def _worker(batch: Batch, limits: BatchLimits = ROOMY) -> tuple[LlmWorker, list[int]]:
    """A worker (not started) and the batch's row count at each of its steps."""
    rows: list[int] = []
    worker = LlmWorker(batch, {EOS}, limits, lambda: rows.append(batch.rows))
    return worker, rows


def test_a_sequence_streams_a_chunk_per_token_and_stops_at_eos(thread: TorchThread) -> None:
    batch = CountingBatch()
    worker, _ = _worker(batch)
    seq = _seq("a", [1, 10])
    worker.submit(seq)
    worker.start(thread)
    _wait(seq)
    worker.stop()
    out = _out(seq)
    assert [c.text for c in out.chunks] == ["l", "m", "n", "o", ""]
    assert out.last.finished and out.last.finish_reason == "stop"
    assert out.last.usage == Usage(prompt_tokens=2, completion_tokens=4, cached_tokens=0)
    assert not any(c.finished for c in out.chunks[:-1])
    assert batch.rows == 0 and worker.running == 0  # the finished row left the batch


def test_a_whole_answer_is_kept_with_its_key(thread: TorchThread) -> None:
    batch = CountingBatch()
    worker, _ = _worker(batch)
    texts: list[str] = []

    def key(text: str) -> int:
        texts.append(text)
        return 77

    ended = _seq("a", [1, 10], answer_key=key)  # l m n o, then the end of turn
    cut = _seq("b", [1, 5], max_tokens=3)  # g h i, cut by max_tokens
    at_once = _seq("c", [1, EOS - 1])  # the end of turn first: no answer at all
    for seq in (ended, cut, at_once):
        worker.submit(seq)
    worker.start(thread)
    _wait(ended, cut, at_once)
    worker.stop()
    # Each answer with its prompt, labelled by its whole text (the client's next
    # assistant message), while its row held exactly those: a cut answer's row has all
    # but its last token (sampled, never fed back).
    assert sorted(batch.remembered) == [
        ([1, 5, 6, 7], None, 4),
        ([1, 10, 11, 12, 13, 14], 77, 6),
    ]
    assert texts == ["lmno"]


def test_max_tokens_and_the_model_window_end_a_sequence_by_length(thread: TorchThread) -> None:
    batch = CountingBatch()
    worker, _ = _worker(batch, BatchLimits(max_num_seqs=8, max_kv_tokens=10_000, max_model_len=5))
    short = _seq("short", [1], max_tokens=2)
    window = _seq("window", [1, 2, 3])  # tokens at positions 3 and 4: the window is full
    worker.submit(short)
    worker.submit(window)
    worker.start(thread)
    _wait(short, window)
    worker.stop()
    assert (_out(short).text, _out(short).last.finish_reason) == ("cd", "length")
    assert (_out(window).text, _out(window).last.finish_reason) == ("ef", "length")


def test_rows_join_up_to_max_num_seqs_and_the_next_waits_for_a_free_one(
    thread: TorchThread,
) -> None:
    batch = CountingBatch()
    worker, rows = _worker(batch, _rows(2))
    seqs = [_seq("a", [12]), _seq("b", [10]), _seq("c", [13])]
    for seq in seqs:
        worker.submit(seq)
    worker.start(thread)
    _wait(*seqs)
    worker.stop()
    assert max(rows) == 2 and batch.widest == 2
    # "c" came in once "a" (two tokens) had finished and left: one row was running.
    assert [(p, running) for p, _, running in batch.prefills] == [([12], 0), ([10], 1), ([13], 1)]
    assert [_out(s).text for s in seqs] == ["no", "lmno", "o"]


def test_a_sequence_that_would_overflow_the_kv_budget_waits_for_the_batch_to_empty(
    thread: TorchThread,
) -> None:
    # Each projects 1 + 4 tokens; two padded rows would need 10 > 9.
    batch = CountingBatch()
    worker, _ = _worker(batch, BatchLimits(max_num_seqs=8, max_kv_tokens=9, max_model_len=1_000))
    first, second = _seq("a", [3], max_tokens=4), _seq("b", [5], max_tokens=4)
    worker.submit(first)
    worker.submit(second)
    worker.start(thread)
    _wait(first, second)
    worker.stop()
    assert [running for _, _, running in batch.prefills] == [0, 0]
    assert batch.widest == 1
    assert (_out(first).text, _out(second).text) == ("efgh", "ghij")


def test_an_abort_drops_the_row_and_nothing_more_is_delivered(thread: TorchThread) -> None:
    batch = CountingBatch()
    worker, _ = _worker(batch)
    keeps, victim = _seq("keeps", [1]), _seq("victim", [1])
    outputs = _out(keeps)

    def deliver_then_abort(item: EngineChunk | BaseException) -> None:
        outputs(item)
        if isinstance(item, EngineChunk) and item.text == "d":  # the first decode step
            worker.abort(victim)

    keeps.deliver = deliver_then_abort
    worker.submit(keeps)
    worker.submit(victim)
    worker.start(thread)
    assert outputs.ended.wait(10)
    worker.stop()
    assert outputs.text == "cdefghijklmno"
    # The victim's token of that same step was never delivered, nor an end.
    assert _out(victim).text == "c" and not _out(victim).ended.is_set()
    assert batch.kept[0] == [0]  # its row (1) left before the next step


def test_an_aborted_waiting_sequence_is_never_prefilled(thread: TorchThread) -> None:
    batch = CountingBatch()
    worker, _ = _worker(batch, _rows(1))
    running, dropped, last = _seq("a", [12]), _seq("b", [1]), _seq("c", [13])
    for seq in (running, dropped, last):
        worker.submit(seq)
    worker.abort(dropped)
    worker.start(thread)
    _wait(running, last)
    worker.stop()
    assert [p for p, _, _ in batch.prefills] == [[12], [13]]
    assert _out(dropped).chunks == [] and _out(dropped).error is None


def test_a_failing_step_fails_every_sequence_and_the_worker_keeps_serving(
    thread: TorchThread,
) -> None:
    batch = CountingBatch()
    batch.fail_decodes = 1
    worker, _ = _worker(batch)
    first, second = _seq("a", [1]), _seq("b", [2])
    worker.submit(first)
    worker.submit(second)
    worker.start(thread)
    _wait(first, second)
    assert [str(_out(s).error) for s in (first, second)] == ["the model broke"] * 2
    assert batch.resets == 1 and worker.running == 0
    after = _seq("c", [12])
    worker.submit(after)
    _wait(after)
    worker.stop()
    assert _out(after).text == "no" and _out(after).last.finish_reason == "stop"


def test_replay_and_labels_reach_prefill_and_cached_prompt_tokens_reach_usage(
    thread: TorchThread,
) -> None:
    batch = CountingBatch(cached=3)
    worker, _ = _worker(batch)
    resumed = _seq(
        "r", [1, 2, 3, 4, 12], replay=2, prompt_tokens=3, prior_tokens=2, prefix_labels={2: 77}
    )
    worker.submit(resumed)
    worker.start(thread)
    _wait(resumed)
    worker.stop()
    assert batch.prefills[0][:2] == ([1, 2, 3, 4, 12], 2)
    assert batch.labels == [{2: 77}]
    usage = _out(resumed).last.usage
    assert usage == Usage(prompt_tokens=3, completion_tokens=2 + 2, cached_tokens=3)


def test_stop_ends_the_loop_and_frees_the_thread(thread: TorchThread) -> None:
    worker, _ = _worker(CountingBatch())
    worker.start(thread)
    worker.stop()
    thread.run(lambda: None).result(timeout=5)  # the loop no longer holds the thread


# -- pacing (StreamPace): at most one delivery per interval ------------------------------

STEP_S = 0.004  # the fake clock: every step (prefill or decode) takes 4 ms


@pytest.fixture
def one_token_opening(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pacing from the second token on, as before answers' openings went unpaced."""
    monkeypatch.setattr(stream_pace, "OPENING", 1)


def _paced_worker(batch: CountingBatch) -> LlmWorker:
    """A worker whose clock is its step count times STEP_S: what is held is known."""
    rows: list[int] = []
    return LlmWorker(
        batch, {EOS}, ROOMY, lambda: rows.append(batch.rows), clock=lambda: len(rows) * STEP_S
    )


def test_paced_text_goes_out_once_per_interval_with_the_first_and_last_at_once(
    thread: TorchThread, one_token_opening: None
) -> None:
    batch = CountingBatch()
    worker = _paced_worker(batch)
    seq = _seq("a", [1, 10], pace=StreamPace(0.010))  # l m n o, then the end
    worker.submit(seq)
    worker.start(thread)
    _wait(seq)
    worker.stop()
    out = _out(seq)
    # l at once (4 ms); m (8) and n (12) held; o (16 ms, 12 after l) takes them along;
    # the end (20 ms) at once.
    assert [c.text for c in out.chunks] == ["l", "mno", ""]
    assert out.last.finished and out.last.finish_reason == "stop"
    assert out.chunks[1].usage == Usage(prompt_tokens=2, completion_tokens=4, cached_tokens=0)


def test_held_text_goes_out_before_another_prefill_and_with_the_finish(
    thread: TorchThread, one_token_opening: None
) -> None:
    order: list[tuple[str, str]] = []
    late = _seq("late", [12], pace=StreamPace(1.0))

    class Batch(CountingBatch):
        decodes = 0

        def prefill(self, ids: list[int], replay: int = 0, labels=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
            order.append(("prefill", "".join(Letters().decode(ids))))
            return super().prefill(ids, replay, labels)

        def decode(self) -> torch.Tensor:
            self.decodes += 1
            if self.decodes == 3:  # d and e are held by now
                worker.submit(late)
            return super().decode()

    batch = Batch()
    worker = _paced_worker(batch)
    first = _seq("first", [1], pace=StreamPace(1.0))  # c .. o
    sinks = {seq.request_id: _out(seq) for seq in (first, late)}
    for seq in (first, late):
        sink = sinks[seq.request_id]

        def logged(item: EngineChunk | BaseException, sink=sink, rid=seq.request_id) -> None:  # type: ignore[no-untyped-def]
            if isinstance(item, EngineChunk):
                order.append((rid, item.text))
            sink(item)

        seq.deliver = logged
    worker.submit(first)
    worker.start(thread)
    assert all(sink.ended.wait(10) for sink in sinks.values())
    worker.stop()
    assert [c.text for c in sinks["first"].chunks] == ["c", "def", "ghijklmno"]
    assert sinks["first"].last.finished
    # What "first" held left before the late prompt's prefill, not after it.
    assert order.index(("first", "def")) < order.index(("prefill", "m"))
    assert [c.text for c in sinks["late"].chunks] == ["n", "o"]


def test_held_text_goes_out_before_a_failure(thread: TorchThread, one_token_opening: None) -> None:
    class Batch(CountingBatch):
        decodes = 0

        def decode(self) -> torch.Tensor:
            self.decodes += 1
            if self.decodes == 3:
                raise RuntimeError("the model broke")
            return super().decode()

    batch = Batch()
    worker = _paced_worker(batch)
    seq = _seq("a", [1], pace=StreamPace(1.0))
    worker.submit(seq)
    worker.start(thread)
    _wait(seq)
    worker.stop()
    out = _out(seq)
    assert [c.text for c in out.chunks] == ["c", "de"]  # the held d and e, then the error
    assert str(out.error) == "the model broke"


def test_an_answers_opening_tokens_go_out_as_they_come_and_then_are_paced(
    thread: TorchThread,
) -> None:
    # A talker speaks the opening phrase as soon as it has its words: none waits.
    batch = CountingBatch()
    worker = _paced_worker(batch)
    seq = _seq("a", [1], pace=StreamPace(1.0))  # c .. o, then the end
    worker.submit(seq)
    worker.start(thread)
    _wait(seq)
    worker.stop()
    opening = [chr(ord("c") + i) for i in range(stream_pace.OPENING)]
    assert stream_pace.OPENING == 8
    assert [c.text for c in _out(seq).chunks] == [*opening, "klmno"]
    assert _out(seq).last.finished


def test_stream_pace_merges_text_usage_and_logprobs() -> None:
    pace = StreamPace(0.010, offered=stream_pace.OPENING - 1)  # past the opening
    first = TokenLogprob(token="a", logprob=-0.1, bytes=None, top_logprobs=[])
    second = TokenLogprob(token="b", logprob=-0.2, bytes=None, top_logprobs=[])
    chunk = EngineChunk(Modality.TEXT, text="a", usage=Usage(completion_tokens=1), logprobs=[first])
    assert pace.offer(chunk, now=1.0) is chunk  # the first goes at once
    later = EngineChunk(
        Modality.TEXT, text="b", usage=Usage(completion_tokens=2), logprobs=[second]
    )
    assert pace.offer(later, now=1.005) is None
    assert pace.take(now=1.006) == EngineChunk(
        Modality.TEXT, text="b", usage=Usage(completion_tokens=2), logprobs=[second]
    )
    assert pace.take(now=1.007) is None  # taken once
    # Held, then merged into the next one due (usage is the later's: it counts both).
    assert pace.offer(EngineChunk(Modality.TEXT, text="c", logprobs=[first]), now=1.010) is None
    out = pace.offer(later, now=1.017)
    assert out is not None and (out.text, out.usage) == ("cb", Usage(completion_tokens=2))
    assert out.logprobs == [first, second]
    # A finish is never held.
    pace.offer(EngineChunk(Modality.TEXT, text="d"), now=1.018)
    end = EngineChunk(Modality.TEXT, finished=True, finish_reason=FinishReason.STOP)
    out = pace.offer(end, now=1.019)
    assert out is not None and (out.text, out.finished, out.finish_reason) == ("d", True, "stop")

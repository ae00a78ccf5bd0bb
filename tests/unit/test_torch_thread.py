"""The llm engine's one torch thread: calls run there, in order, results and errors
handed back."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("torch")

from omnistage.engines.torch_threads import TorchThread


def test_calls_run_in_order_on_one_thread_with_their_results() -> None:
    thread = TorchThread("test-torch")
    seen: list[tuple[int, int]] = []

    def call(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * i

    futures = [thread.run(lambda i=i: call(i)) for i in range(5)]
    assert [f.result(5) for f in futures] == [0, 1, 4, 9, 16]
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert {ident for _, ident in seen} == {thread.ident}
    assert thread.ident != threading.get_ident()


def test_an_error_goes_to_the_caller_and_the_thread_goes_on() -> None:
    thread = TorchThread("test-torch")

    def boom() -> None:
        raise ValueError("no model")

    with pytest.raises(ValueError, match="no model"):
        thread.run(boom).result(5)
    assert thread.run(lambda: "still here").result(5) == "still here"

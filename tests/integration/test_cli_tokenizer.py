"""What benchmark clients need: ``omnistage tokenizer`` (a local tokenizer directory to
give them instead of a hub id) and ``serve --served-model-name`` (the names the API
answers to)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omnistage.cli.args import build_parser, validate
from tests.integration.harness import HeadProc

ALIAS = "HuggingFaceTB/SmolLM2-135M-Instruct"
M = ["-oma", "127.0.0.1", "-omp", "1"]


def _omnistage(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omnistage", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_tokenizer_prints_a_directory_transformers_loads_offline() -> None:
    # The first run on a machine converts the packaged GGUF (~30 s); later ones reuse it.
    result = _omnistage("tokenizer", timeout=110)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout  # alone on stdout, for $(omnistage tokenizer)
    path = Path(lines[0])
    assert (path / "tokenizer.json").is_file()
    assert (path / "tokenizer_config.json").is_file()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tokenizer.encode("Hello", add_special_tokens=False)
    assert ids and tokenizer.decode(ids) == "Hello"
    chat = [{"role": "user", "content": "Hello"}]
    assert "<|im_start|>user" in tokenizer.apply_chat_template(chat, tokenize=False)
    # Naming the stage, by name or id, finds the same directory.
    for stage in ("thinker", "0"):
        named = _omnistage("tokenizer", "voice", "--stage", stage, timeout=110)
        assert named.returncode == 0 and named.stdout.strip() == str(path), named.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stage", "talker"], "stage 1 (talker) runs the 'tts' engine, not llm"),
        (["--stage", "1"], "stage 1 (talker) runs the 'tts' engine, not llm"),
        (["--stage", "narrator"], "--stage narrator: no such stage in 'voice'"),
        (["--stage", "7"], "--stage 7: no such stage in 'voice'"),
        (["echo"], "pipeline 'echo' has no llm stage"),
        (["no-such-pipeline"], "is neither a deploy config file nor a built-in pipeline"),
    ],
)
def test_tokenizer_of_no_llm_stage_exits_2_with_one_line(args: list[str], message: str) -> None:
    result = _omnistage("tokenizer", *args)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("omnistage tokenizer: error:")
    assert message in lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--served-model-name", ""], "--served-model-name: a name must not be empty"),
        (["--served-model-name", "a", " "], "--served-model-name: a name must not be empty"),
        (
            ["--headless", "--stage-id", "0", *M, "--served-model-name", "a"],
            "--served-model-name is for the head",
        ),
    ],
)
def test_invalid_served_model_name_exits_2(args: list[str], message: str) -> None:
    result = _omnistage("serve", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("omnistage serve: error:") and message in lines[0]


def test_served_model_names_keep_their_order() -> None:
    args = build_parser().parse_args(["serve", "--served-model-name", "b", "a"])
    validate(args)
    assert args.served_model_name == ["b", "a"]
    assert build_parser().parse_args(["serve"]).served_model_name is None


def _answers_to_the_alias(head: HeadProc) -> None:
    models = head.client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [ALIAS, "smol"]
    assert head.client.get(f"/v1/models/{ALIAS}").json()["id"] == ALIAS
    assert head.client.get("/v1/models/smol").json()["id"] == "smol"
    assert head.client.get("/v1/models/echo").status_code == 404
    for name in (ALIAS, "smol"):
        ok = head.chat("hi", model=name)
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["message"]["content"]
        assert ok.json()["model"] == ALIAS  # responses report the first name
    refused = head.chat("hi", model="echo")
    assert refused.status_code == 404, refused.text
    assert refused.json()["error"]["code"] == "model_not_found"
    assert ALIAS in refused.json()["error"]["message"]
    no_model = head.client.post("/v1/completions", json={"prompt": "hi"})
    assert no_model.status_code == 200, no_model.text  # `model` may be left out
    assert no_model.json()["model"] == ALIAS


@pytest.fixture(scope="module")
def aliased(module_tmp: Path) -> Iterator[HeadProc]:
    head = HeadProc(module_tmp, "echo", "--served-model-name", ALIAS, "smol", name="aliased")
    try:
        head.wait_healthy()
        yield head
    finally:
        head.stop()


def test_served_model_name_replaces_the_pipeline_name(aliased: HeadProc) -> None:
    _answers_to_the_alias(aliased)


def test_api_server_processes_answer_to_the_served_model_name(module_tmp: Path) -> None:
    head = HeadProc(
        module_tmp,
        "echo",
        "--api-server-count",
        "2",
        "--served-model-name",
        ALIAS,
        "smol",
        name="aliased-fronted",
    )
    try:
        head.wait_healthy()
        # New connections: the kernel hands each to either server.
        for _ in range(4):
            with httpx.Client(base_url=head.url, timeout=30) as client:
                ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
                assert ids == [ALIAS, "smol"]
        _answers_to_the_alias(head)
    finally:
        head.stop()

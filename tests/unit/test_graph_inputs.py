"""A request runs only the stages its input and outputs need (speech in, text in)."""

from __future__ import annotations

from omnistage.config.schema import DeployConfig
from omnistage.dataplane.graph import StageGraph
from omnistage.engines.llm.prompts import with_heard
from omnistage.protocol.messages import ChatMessage, Prompt

TEXT, AUDIO = frozenset({"text"}), frozenset({"audio"})
BOTH = TEXT | AUDIO


def _voice_with_listener() -> StageGraph:
    return StageGraph(
        DeployConfig.model_validate(
            {
                "pipeline": "v",
                "stages": [
                    {
                        "stage_id": 0,
                        "name": "thinker",
                        "engine": "echo",
                        "inputs": [2],
                        "prompt_modalities": ["text"],
                        "final_output": True,
                    },
                    {
                        "stage_id": 1,
                        "name": "talker",
                        "engine": "echo",
                        "inputs": [0],
                        "final_output": True,
                        "output_modality": "audio",
                    },
                    {
                        "stage_id": 2,
                        "name": "listener",
                        "engine": "echo",
                        "prompt_modalities": ["audio"],
                    },
                ],
            }
        )
    )


def test_a_text_request_skips_the_listener_and_an_audio_one_runs_it() -> None:
    g = _voice_with_listener()
    assert g.required_for([0], TEXT) == {0}
    assert g.required_for([0, 1], TEXT) == {0, 1}
    assert g.required_for([0, 1], BOTH) == {0, 1, 2}
    assert g.required_for([0], AUDIO) == {0, 2}
    # Nothing said about the input: every upstream stage, as before.
    assert g.required_for([0]) == {0, 2}


def test_who_gets_the_client_prompt() -> None:
    g = _voice_with_listener()
    # The thinker reads the client's messages even when the listener feeds it.
    assert g.prompt_for(0, active_upstream=True) and g.prompt_for(0, active_upstream=False)
    # The talker reads only its upstream (unless run alone).
    assert not g.prompt_for(1, active_upstream=True) and g.prompt_for(1, active_upstream=False)
    assert g.stages_reading("audio") == [2]


def test_prompt_modalities() -> None:
    assert Prompt(text="x").modalities() == TEXT
    assert Prompt(messages=[], audio=b"a").modalities() == BOTH
    assert Prompt(audio=b"a").modalities() == AUDIO
    assert Prompt().modalities() == frozenset()
    assert Prompt(text="x", videos=[b"v"]).modalities() == TEXT | {"video"}


def test_the_transcript_completes_the_last_user_turn() -> None:
    prompt = Prompt(
        messages=[
            ChatMessage("system", "be brief"),
            ChatMessage("user", "earlier"),
            ChatMessage("assistant", "ok"),
            ChatMessage("user", "Answer this:"),
        ]
    )
    merged = with_heard(prompt, " what is the capital of France?")
    assert merged.messages is not None
    assert merged.messages[-1] == ChatMessage(
        "user", "Answer this:\nwhat is the capital of France?"
    )
    assert merged.messages[:3] == prompt.messages[:3]
    # An audio-only user turn becomes the transcript; no upstream text changes nothing.
    only_audio = Prompt(messages=[ChatMessage("user", "")])
    assert with_heard(only_audio, "hello").messages == [ChatMessage("user", "hello")]
    assert with_heard(prompt, "") is prompt
    assert with_heard(None, "hi").messages == [ChatMessage("user", "hi")]

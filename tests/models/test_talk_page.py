"""GET /talk in a real headless Chromium whose microphone is a WAV file of a spoken
question, against the real voice pipeline: the page calls /v1/realtime/calls (WebRTC)
with the microphone, semantic VAD ends the turn, and the page shows both transcripts and
plays the spoken answer.

Needs Chromium, its driver and Selenium (see ``tests.browser``). The question is said
by the pipeline's own Piper voice (``/v1/audio/speech``) at test time, padded with
silence: some before, so that capture is running when the words start, and enough
after for the server to hear the end of the turn.
"""

from __future__ import annotations

import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omnistage.audio.resample import resample
from tests.browser import chromium, require_chromium, wait
from tests.integration.harness import HeadProc
from tests.speech import heard_as

pytestmark = pytest.mark.slow
require_chromium("the talk page test")
from selenium.webdriver.common.by import By  # noqa: E402

QUESTION = "What is the capital of France?"
SPEECH_RATE = 24000  # OpenAI's pcm response_format
CAPTURE_RATE = 48000  # Chromium's own capture rate: its fake device need not resample
LEAD_S, TAIL_S = 1.0, 2.5  # silence before and after the words
ANSWER_TIMEOUT_S = 180  # listener, thinker and talker on two shared CPU cores
KEY = "talk page key"


@pytest.fixture(scope="module")
def question_wav(voice_client: openai.OpenAI, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """QUESTION said by the Piper voice, as a 48 kHz mono 16-bit WAV with silence around."""
    pcm = voice_client.audio.speech.create(
        model="voice", voice="joe", input=QUESTION, response_format="pcm"
    ).content
    speech = resample(np.frombuffer(pcm, dtype="<i2"), SPEECH_RATE, CAPTURE_RATE)
    lead = np.zeros(int(LEAD_S * CAPTURE_RATE), dtype=np.int16)
    tail = np.zeros(int(TAIL_S * CAPTURE_RATE), dtype=np.int16)
    path = tmp_path_factory.mktemp("talk") / "question.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(CAPTURE_RATE)
        w.writeframes(np.concatenate([lead, speech, tail]).astype("<i2").tobytes())
    return path


@pytest.fixture
def browser(question_wav: Path) -> Iterator[Any]:
    """Chromium with ``question_wav`` as its microphone (played once, per capture) and
    no permission prompt. One per test: the fake device reads its file from the start
    when the browser first opens it."""
    driver = chromium(
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={question_wav}%noloop",
        "--autoplay-policy=no-user-gesture-required",
    )
    try:
        yield driver
    finally:
        driver.quit()


def _turns(browser: Any, role: str) -> list[dict[str, Any]]:
    """The page's finished (no longer pending) ``role`` turns: item id and text."""
    return browser.execute_script(
        "return [...document.querySelectorAll('.turn.' + arguments[0] + ':not(.pending)')]"
        ".map(e => ({item: e.dataset.item, text: e.querySelector('.text').textContent}))",
        role,
    )


def _status(browser: Any) -> str:
    return browser.find_element(By.ID, "status").text


def _talk_and_check_the_answer(browser: Any) -> None:
    """Click Talk, and wait for the transcript of QUESTION, a spoken answer and its
    transcript; then hang up."""
    button = browser.find_element(By.ID, "talk")
    assert button.text == "Talk"
    button.click()
    wait(
        browser,
        lambda b: b.find_element(By.ID, "conn").get_attribute("data-state") == "live",
        30,
        f"the call to be live (status: {_status(browser)!r})",
    )
    assert button.text == "Stop"

    def heard(b: Any) -> list[dict[str, Any]] | None:
        found = [t for t in _turns(b, "user") if t["text"].strip()]
        return found or None

    def answered(b: Any) -> list[dict[str, Any]] | None:
        if b.find_element(By.ID, "status").get_attribute("class") == "error":
            raise AssertionError(f"the page shows an error: {_status(b)!r}")
        found = [t for t in _turns(b, "assistant") if t["text"].strip()]
        return found or None

    user = wait(browser, heard, ANSWER_TIMEOUT_S, "the user's transcript")
    said = " ".join(t["text"] for t in user)
    print(f"user transcript: {said!r}")
    assert heard_as(said, QUESTION), said
    answer = wait(browser, answered, ANSWER_TIMEOUT_S, "the assistant's transcript")
    print(f"assistant transcript: {answer[0]['text']!r}")
    # The page calls over WebRTC (the head offers 127.0.0.1, which Chromium reaches).
    transport = browser.find_element(By.TAG_NAME, "body").get_attribute("data-transport")
    assert transport == "webrtc", transport

    def played(b: Any) -> int | None:
        # Over a call the audio is the track's (paced in real time), which may start
        # after the transcript's first words are shown.
        chunks = int(b.find_element(By.TAG_NAME, "body").get_attribute("data-audio-chunks"))
        return chunks or None

    chunks = wait(browser, played, ANSWER_TIMEOUT_S, "the answer's audio to play")
    print(f"loud moments of the answer played: {chunks}")
    # The answer's bubble is keyed by its item, which is not the user's.
    assert answer[0]["item"] and answer[0]["item"] not in {t["item"] for t in user}
    button.click()
    assert button.text == "Talk"
    assert browser.find_element(By.ID, "conn").get_attribute("data-state") == "idle"


def test_a_spoken_question_is_transcribed_and_answered_aloud(
    voice_head: HeadProc, browser: Any
) -> None:
    browser.get(f"{voice_head.url}/talk")
    assert browser.title == "omnistage talk"
    _talk_and_check_the_answer(browser)
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-auth") == "none"


def test_with_an_api_key_the_page_connects_with_a_client_secret(
    voice_head: HeadProc, tmp_path: Path, browser: Any
) -> None:
    probe = httpx.post(f"{voice_head.url}/v1/realtime/client_secrets", json={}, timeout=30)
    if probe.status_code in (404, 405):
        pytest.skip("POST /v1/realtime/client_secrets is not on this branch yet")
    head = HeadProc(tmp_path, "voice", "--api-key", KEY, name="keyed-voice-head")
    try:
        head.wait_healthy(timeout=300)
        browser.get(f"{head.url}/talk")
        browser.find_element(By.ID, "talk").click()
        wait(browser, lambda b: "API key" in _status(b), 30, "the page to ask for the key")
        # ?key= is remembered and taken out of the address bar.
        browser.get(f"{head.url}/talk?key={KEY.replace(' ', '%20')}")
        assert "key=" not in browser.current_url
        assert browser.find_element(By.ID, "key").get_attribute("value") == KEY
        _talk_and_check_the_answer(browser)
        assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-auth") == (
            "client_secret"
        )
    finally:
        head.stop()

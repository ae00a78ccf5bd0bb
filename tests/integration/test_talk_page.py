"""GET /talk over a real echo head with ``--api-key``, in a real headless Chromium: the
page is served without the key, and without one it says so instead of connecting.
Talking through it, with the real voice pipeline: tests/models/test_talk_page.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import chromium, require_chromium, wait
from tests.integration.harness import HeadProc

require_chromium("the talk page test")
from selenium.webdriver.common.by import By  # noqa: E402

KEY = "talk key"


@pytest.fixture(scope="module")
def keyed_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HeadProc]:
    head = HeadProc(tmp_path_factory.mktemp("talk"), "echo", "--api-key", KEY)
    try:
        head.wait_healthy()
        yield head
    finally:
        head.stop()


def test_the_page_is_served_without_the_key(keyed_head: HeadProc) -> None:
    r = httpx.get(f"{keyed_head.url}/talk")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    csp = r.headers["content-security-policy"]
    assert "connect-src 'self'" in csp and "blob:" in csp
    assert '<button id="talk"' in r.text


def test_without_a_key_the_page_asks_for_one(keyed_head: HeadProc) -> None:
    driver: Any = chromium("--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream")
    try:
        driver.get(f"{keyed_head.url}/talk")
        button = driver.find_element(By.ID, "talk")
        assert button.text == "Talk"
        button.click()
        status = driver.find_element(By.ID, "status")
        wait(driver, lambda b: "API key" in status.text, 10, "the page to ask for the key")
        assert "error" in status.get_attribute("class")
        assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "error"
        assert button.text == "Talk"
    finally:
        driver.quit()


def test_the_page_file_has_no_external_urls() -> None:
    page = Path(__file__).parents[2] / "omnistage" / "api" / "static" / "talk.html"
    text = page.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text and "//cdn" not in text


def _goes_live(driver: Any, url: str) -> str:
    """Open the page with the key, click Talk, wait for the call to be live; the
    transport it went live on."""
    driver.get(f"{url}/talk?key={KEY.replace(' ', '%20')}")
    driver.find_element(By.ID, "talk").click()
    conn = driver.find_element(By.ID, "conn")
    wait(driver, lambda b: conn.get_attribute("data-state") == "live", 30, "the call to be live")
    transport = driver.find_element(By.TAG_NAME, "body").get_attribute("data-transport")
    driver.find_element(By.ID, "talk").click()  # hang up
    return transport


def test_the_page_calls_over_webrtc(keyed_head: HeadProc) -> None:
    driver: Any = chromium("--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream")
    try:
        assert _goes_live(driver, keyed_head.url) == "webrtc"
        assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-auth") == (
            "client_secret"
        )
    finally:
        driver.quit()


def test_where_webrtc_cannot_connect_the_page_uses_the_websocket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A head whose calls offer only an address it cannot have: no ICE candidate at all.
    monkeypatch.setenv("OMNISTAGE_WEBRTC_HOSTS", "192.0.2.1")
    head = HeadProc(tmp_path, "echo", "--api-key", KEY, name="no-ice-head")
    driver: Any = None
    try:
        head.wait_healthy()
        driver = chromium("--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream")
        assert _goes_live(driver, head.url) == "websocket"
    finally:
        if driver is not None:
            driver.quit()
        head.stop()

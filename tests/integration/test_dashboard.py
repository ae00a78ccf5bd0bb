"""GET /dashboard in a real headless Chromium, over a real echo head.

Needs Chromium, its driver and Selenium (see ``tests.browser``). With
``OMNISTAGE_SCREENSHOT=docs/dashboard.png`` the first test saves the page there.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import chromium, require_chromium
from tests.browser import wait as _wait
from tests.integration.harness import HeadProc

require_chromium("the dashboard test")
from selenium.webdriver.common.by import By  # noqa: E402

PAGE = Path(__file__).parents[2] / "omnistage" / "api" / "static" / "dashboard.html"
TWO_TALKERS = '{"1": {"replicas": 2}}'
KEY = "dashboard key"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = chromium()
    try:
        yield driver
    finally:
        driver.quit()


def _replicas(browser: Any) -> dict[tuple[int, int], str]:
    """(stage id, replica id) -> state, as the page shows them."""
    found = browser.execute_script(
        "return [...document.querySelectorAll('.replica')].map("
        "e => [e.dataset.stage, e.dataset.replica, e.dataset.state])"
    )
    return {(int(s), int(r)): state for s, r, state in found}


def _texts(browser: Any, css: str) -> list[str]:
    """The text of every element ``css`` selects, read in one script: the page re-renders
    on every event, so an element found by one WebDriver call can be gone by the next."""
    return browser.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.innerText)", css
    )


def _numbers(browser: Any, metric: str, replicas: set[tuple[int, int]]) -> Any:
    """{stage id: the page's number for ``metric``}, or False until every stage has one."""
    found = browser.execute_script(
        "return [...document.querySelectorAll('[data-stage][data-metric=\"' + arguments[0]"
        " + '\"]')].map(e => [e.dataset.stage, e.textContent])",
        metric,
    )
    values = {}
    for sid, text in found:
        try:
            values[int(sid)] = float(text)
        except ValueError:
            return False
    return values if set(values) == {s for s, _ in replicas} else False


def test_the_page_computes_quantiles_as_histogram_quantile(browser: Any) -> None:
    """``omniQuantile(bounds, counts, q)``: linear within the bucket, 0 as the first
    bucket's lower bound, the last bound for the bucket above it, null when empty.
    The page's file itself, no head: its stream just fails to connect."""
    browser.get(PAGE.as_uri())
    q = "return window.omniQuantile(arguments[0], arguments[1], arguments[2])"
    bounds = [0.01, 0.1, 1.0]
    cases = [
        ([4, 0, 0, 0], 0.5, 0.005),
        ([0, 4, 0, 0], 0.5, 0.055),
        ([0, 2, 2, 0], 0.5, 0.1),
        ([0, 2, 2, 0], 0.75, 0.55),
        ([1, 0, 0, 9], 0.99, 1.0),
        ([0, 0, 0, 0], 0.5, None),
    ]
    for counts, quantile, want in cases:
        got = browser.execute_script(q, bounds, counts, quantile)
        assert got == pytest.approx(want) if want is not None else got is None, (counts, got)


def _traffic(head: HeadProc, seconds: float) -> None:
    """Requests one after another, at a rate that varies, for ``seconds``."""
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        assert head.chat(f"hello {i}").status_code == 200
        time.sleep(0.005 * (i % 10))
        i += 1


def test_the_dashboard_shows_every_replica_and_a_killed_one_without_reloading(
    tmp_path: Path, browser: Any
) -> None:
    head = HeadProc(tmp_path, "echo", "--stage-overrides", TWO_TALKERS)
    try:
        head.wait_healthy()
        head.wait_up(1, 2)
        expected = {
            (s["stage_id"], r["replica_id"]) for s in head.stages()["stages"] for r in s["replicas"]
        }
        assert len(expected) == 4
        browser.get(f"{head.url}/dashboard")
        _wait(
            browser,
            lambda b: _replicas(b) == dict.fromkeys(expected, "UP"),
            10,
            "every replica UP on the page",
        )
        names = [t.split()[0] for t in _texts(browser, ".stage h2")]
        assert names == ["thinker", "talker", "vocoder"]
        assert len(browser.find_elements(By.CSS_SELECTOR, "#edges path.edge")) == 2
        shot = os.environ.get("OMNISTAGE_SCREENSHOT")
        _traffic(head, 8.0 if shot else 1.0)  # something for the charts to draw
        p50s = _wait(
            browser,
            lambda b: _numbers(b, "p50_duration", expected),
            5,
            "a p50 stage duration for every stage",
        )
        print(f"p50 stage durations on the page (ms): {p50s}")
        assert _texts(browser, '[data-metric="429_per_min"]') == ["0"]
        # Not 0: /health answers 503 until the head is ready, and the harness polls it.
        assert int(_texts(browser, '[data-metric="5xx_total"]')[0]) >= 0
        kinds = _texts(browser, '[data-metric="p50_e2e"]')
        assert kinds and all(float(t) >= 0 for t in kinds)

        victim = head.up_replicas(1)[0]
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        key = (1, victim["replica_id"])
        state = _wait(
            browser,
            lambda b: _replicas(b).get(key) in ("ERROR", "DOWN") and _replicas(b)[key],
            2,
            "the killed replica ERROR or DOWN on the page",
        )
        seen_after = time.monotonic() - killed_at
        print(f"killed replica shown {state} after {seen_after:.2f} s")
        (changes,) = _texts(browser, "#changes")
        assert f"talker #{victim['replica_id']} UP \u2192 {state}" in changes
        if shot:
            size = {"width": 1200, "height": 800, "deviceScaleFactor": 1, "mobile": False}
            browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", size)
            time.sleep(1.0)
            assert browser.save_screenshot(shot)
    finally:
        head.stop()


def test_a_replica_the_head_restarts_shows_restarting_with_its_due_time(
    tmp_path: Path, browser: Any
) -> None:
    slow_talker = '{"1": {"engine_args": {"start_delay_s": 3}}}'
    head = HeadProc(tmp_path, "echo", "--stage-overrides", slow_talker)
    try:
        head.wait_healthy()
        browser.get(f"{head.url}/dashboard")
        _wait(browser, lambda b: len(_replicas(b)) == 3, 10, "every replica on the page")
        (talker,) = head.up_replicas(1)
        os.kill(talker["pid"], signal.SIGKILL)

        # The page re-renders its rows on every event, so an element found in one
        # call can be gone by the next: each check reads the page in one script.
        def talker_row(b: Any) -> str:
            text = b.execute_script(
                "const r = document.querySelector('.replica[data-stage=\"1\"]');"
                "return r ? r.innerText : '';"
            )
            return text if "restarting" in text else ""

        text = _wait(browser, talker_row, 10, "the talker's slot restarting")
        assert "ERROR \u00b7 restarting" in text
        assert "restart due" in text or "restarting since" in text

        def stage_restarting(b: Any) -> bool:
            restarting, metas = b.execute_script(
                "const s = document.querySelector('.stage[data-stage=\"1\"]');"
                "if (!s) return [false, []];"
                "return [s.classList.contains('restarting'),"
                " [...s.querySelectorAll('.meta')].map(m => m.innerText)];"
            )
            return restarting and any(m.startswith("restarting") for m in metas)

        _wait(browser, stage_restarting, 5, "the talker's stage restarting")
        _wait(browser, lambda b: _replicas(b).get((1, 0)) == "UP", 30, "the talker back UP")
    finally:
        head.stop()


def test_with_an_api_key_the_page_asks_for_it_or_takes_it_from_the_fragment(
    tmp_path: Path, browser: Any
) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--api-key", KEY)
    try:
        head.wait_healthy()
        assert httpx.get(f"{head.url}/dashboard").status_code == 200  # the page holds no data
        with httpx.stream("GET", f"{head.url}/v1/omni/events") as r:
            assert r.status_code == 401

        browser.get(f"{head.url}/dashboard")
        form = browser.find_element(By.ID, "keyform")
        _wait(browser, lambda b: form.is_displayed(), 10, "the key form")
        browser.find_element(By.ID, "key").send_keys(KEY)
        form.submit()
        _wait(browser, lambda b: _replicas(b) == {(0, 0): "UP"}, 10, "the stage after the key")

        browser.get("about:blank")
        browser.get(f"{head.url}/dashboard#key={KEY.replace(' ', '%20')}")
        _wait(browser, lambda b: _replicas(b) == {(0, 0): "UP"}, 10, "the stage with #key=")
        assert not browser.find_element(By.ID, "keyform").is_displayed()
    finally:
        head.stop()


def test_the_live_voice_panel_appears_with_a_session_and_counts_it(
    tmp_path: Path, browser: Any
) -> None:
    from websockets.sync.client import connect

    head = HeadProc(tmp_path, "echo-1stage")
    try:
        head.wait_healthy()
        browser.get(f"{head.url}/dashboard")
        _wait(browser, lambda b: _replicas(b) == {(0, 0): "UP"}, 10, "the page's stage")
        panel = browser.find_element(By.ID, "voice")
        assert not panel.is_displayed()  # no session yet: no panel

        def shown(metric: str) -> str:
            (text,) = _texts(browser, f'[data-metric="{metric}"]')
            return text

        url = head.url.replace("http://", "ws://") + "/v1/realtime"
        with connect(url) as ws:
            assert '"session.created"' in str(ws.recv(timeout=10))
            _wait(browser, lambda b: panel.is_displayed(), 5, "the Live voice panel")
            _wait(browser, lambda b: shown("voice_live") == "1", 5, "1 session open")
            assert shown("voice_sessions") == "1"
            assert shown("voice_p50") == "\u2013"  # no answer yet
        _wait(browser, lambda b: shown("voice_live") == "0", 5, "the session closed")
        assert panel.is_displayed() and shown("voice_sessions") == "1"
    finally:
        head.stop()


def test_the_heads_of_a_fleet_show_in_the_header_and_a_killed_one_goes_down(
    tmp_path: Path, browser: Any
) -> None:
    flags = ("echo-1stage", "--stage-id", "0", "--omni-dp-size-local", "0")
    first = HeadProc(tmp_path, *flags, name="first")
    second = None
    try:
        first.wait_http()
        join = ("--omni-join", f"127.0.0.1:{first.master_port}")
        second = HeadProc(tmp_path, *flags, *join, name="second")
        second.wait_http()
        browser.get(f"{second.url}/dashboard")
        me, other = f"127.0.0.1:{second.master_port}", f"127.0.0.1:{first.master_port}"

        def heads(b: Any) -> Any:
            el = b.find_element(By.ID, "heads")
            return el.is_displayed() and el.text

        _wait(browser, lambda b: other in (heads(b) or ""), 10, "both heads shown")
        assert heads(browser).startswith(f"heads: {me} (this) UP")
        first.signal(signal.SIGKILL)
        _wait(browser, lambda b: f"{other} DOWN" in (heads(b) or ""), 15, "the killed head DOWN")
    finally:
        if second is not None:
            second.stop()
        first.stop()

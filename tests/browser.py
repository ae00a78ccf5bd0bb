"""Headless Chromium for the page tests (/dashboard, /talk), driven by Selenium.

Needs Debian's ``chromium`` and ``chromium-driver`` (scripts/test.sh installs them as
root) and Selenium, which is pointed at both so that it downloads nothing. A test module
calls ``require_chromium()`` at import: without them it is skipped, with the reason.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


def require_chromium(what: str) -> None:
    """Skip the calling module unless Chromium, its driver and Selenium are all here."""
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip(
            f"{what} needs chromium and chromedriver on PATH "
            "(apt-get install chromium chromium-driver)",
            allow_module_level=True,
        )
    pytest.importorskip("selenium.webdriver", reason="needs selenium (the test extra)")


def chromium(*args: str) -> Any:
    """A headless Chromium with ``args`` added to the usual flags; ``quit()`` it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert CHROMIUM and CHROMEDRIVER
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1200,800")
    for arg in args:
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


def wait(browser: Any, check: Callable[[Any], Any], timeout: float, what: str) -> Any:
    """``check(browser)``'s first truthy value, polled every 50 ms for ``timeout`` s."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(
        lambda b: check(b), message=f"timed out waiting for {what}"
    )

"""Headless Chromium for the console's browser tests, driven by Selenium.

The ``browser`` fixture (registered for ``tests/e2e`` by its ``conftest.py``) yields a fresh
Chromium per test (its own temporary profile: a new ``sessionStorage``, no cache), with the
browser's console log kept (:func:`console_errors`). Debian's ``chromium`` and
``chromium-driver`` are used (``make test`` installs them where it may: as root, with
apt-get); without them, or without Selenium, the tests skip and say why.
:func:`save_screenshot` keeps a screenshot under ``$INFER_TEST_ARTIFACTS`` (default: the
system's temporary folder's ``infer-test-artifacts``).
"""

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# What keeps a headless Chromium quiet, offline and alone: no sandbox (root in CI), no GPU,
# no background traffic (updates, sync, QUIC), a profile of its own.
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)
WAIT_S = 20.0


def artifacts_dir() -> Path:
    """Where screenshots go: ``$INFER_TEST_ARTIFACTS``, or a folder in the system's temp."""
    folder = Path(
        os.environ.get("INFER_TEST_ARTIFACTS")
        or Path(tempfile.gettempdir()) / "infer-test-artifacts"
    )
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_screenshot(driver: Any, name: str) -> Path:
    """The page as it is now, as ``<artifacts>/<name>.png``; returns the path."""
    path = artifacts_dir() / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def missing() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not path.exists():
            return f"no {path}: apt-get install -y chromium chromium-driver ({package})"
    return None


def new_driver(profile: Path) -> Any:
    """A headless Chromium on ``profile`` (a new, empty folder)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    return driver


def console_errors(driver: Any) -> list[str]:
    """The browser console's errors since the last call (CSP violations, uncaught errors)."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def wait_for(driver: Any, condition: Callable[[Any], Any], timeout_s: float = WAIT_S) -> Any:
    """``condition(driver)``'s first truthy value, polled until ``timeout_s``."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(condition)


@pytest.fixture
def browser() -> Iterator[Any]:
    """A fresh headless Chromium (skips the test where there is none)."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    profile = Path(tempfile.mkdtemp(prefix="infer-chromium-"))
    driver = new_driver(profile)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)

"""The console's Models page in headless Chromium against a real `infer serve --enable-lora`
(the default model served as ``base``; a keys file with an admin key): the served models
listed, a PEFT adapter folder loaded from the form (listed at once, served), a bad folder's
400 read on the page, the adapter unloaded with its button, and a hostile name kept text.
Screenshots go to the test artifacts (``tests/e2e/browser.py``)."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.weights.resolve import resolve_model
from tests.e2e.browser import browser, console_errors, save_screenshot, wait_for
from tests.e2e.server import keyed_serve
from tests.support.peft_adapters import random_adapter

pytestmark = pytest.mark.slow
OPS_KEY = "sk-ops-models"
__all__ = ["browser"]  # the fixture, used by name


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("models")
    flags = ("--served-model-name", "base", "--enable-lora")
    with keyed_serve(folder, {"ops": OPS_KEY}, *flags) as url:
        yield url


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = resolve_model(None, progress=False).path
    return random_adapter(tmp_path_factory.mktemp("peft") / "sql", model, rank=4)


ROWS_JS = """
return [...document.querySelectorAll('#models-table tbody tr')].map((row) => {
  const cells = [...row.querySelectorAll('td')].map((td) => td.textContent);
  const unload = !!row.querySelector('button.unload');
  return {id: cells[0], kind: cells[1], parent: cells[2], unload};
});
"""


def open_models(driver: Any, url: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{url}/#models")
    field = wait_for(driver, lambda d: d.find_elements(By.ID, "api-key"))[0]
    field.send_keys(OPS_KEY)
    driver.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()
    wait_for(driver, lambda d: d.execute_script(ROWS_JS))


def submit(driver: Any, name: str, path: str) -> str:
    from selenium.webdriver.common.by import By

    for field, value in (("lora-name", name), ("lora-path", path)):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    before = driver.find_element(By.ID, "lora-answer").text
    driver.find_element(By.ID, "lora-load").click()
    wait_for(
        driver, lambda d: d.find_element(By.ID, "lora-answer").text not in ("", before, "Loading…")
    )
    return str(driver.find_element(By.ID, "lora-answer").text)


def test_an_adapter_is_loaded_served_and_unloaded_from_the_page(
    browser: Any, server: str, adapter: Path
) -> None:
    from selenium.webdriver.common.by import By

    open_models(browser, server)
    assert browser.execute_script(ROWS_JS)[0] == {
        "id": "base",
        "kind": "base model",
        "parent": "—",
        "unload": False,
    }
    answer = submit(browser, "sql", str(adapter))
    assert answer == "Success: LoRA adapter 'sql' added successfully."
    rows = wait_for(browser, lambda d: [r for r in d.execute_script(ROWS_JS) if r["id"] == "sql"])
    assert rows[0]["kind"] == "LoRA adapter (loaded at run time)" and rows[0]["unload"]
    auth = {"Authorization": f"Bearer {OPS_KEY}"}
    reply = httpx.post(
        f"{server}/v1/completions",
        json={"model": "sql", "prompt": "Hi", "max_tokens": 2},
        headers=auth,
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    refused = submit(browser, "other", str(adapter.parent / "missing"))
    assert "no such folder" in refused
    hostile = "<img src=x onerror=window.__xss=1>"
    submit(browser, hostile, str(adapter))
    wait_for(browser, lambda d: [r for r in d.execute_script(ROWS_JS) if r["id"] == hostile])
    assert browser.execute_script("return window.__xss") is None  # its name stayed text
    save_screenshot(browser, "console-models")
    for name in ("sql", hostile):
        button = next(
            b
            for b in browser.find_elements(By.CSS_SELECTOR, "button.unload")
            if b.get_attribute("data-model") == name
        )
        button.click()
        wait_for(
            browser, lambda d, name=name: all(r["id"] != name for r in d.execute_script(ROWS_JS))
        )
    gone = httpx.post(
        f"{server}/v1/completions",
        json={"model": "sql", "prompt": "Hi", "max_tokens": 2},
        headers=auth,
        timeout=60,
    )
    assert gone.status_code == 404
    assert not [e for e in console_errors(browser) if "SEVERE" in e and "400" not in e]

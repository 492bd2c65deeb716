"""The web console in a real browser (headless Chromium through Selenium, ``browser.py``).

Against a real ``infer serve`` (the default model): a chat streams into the playground, the
engine view's running counter moves while requests run, and no page breaks its CSP.
Against the server's app on the fake model in this process (its answers scripted): a
completion, a tool call and a model name made of ``<script>`` and ``<img onerror>`` stay
text, and with a keys file the page asks for a key and keeps it for the browser tab only.
Screenshots go to the test artifacts (``$INFER_TEST_ARTIFACTS``).
"""

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from dependency_injector import providers

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.http.console.security import CONTENT_SECURITY_POLICY
from application.access.keys import hash_key
from tests.e2e.browser import console_errors, save_screenshot, wait_for
from tests.e2e.server import infer_serve
from tests.fakes import fake_container
from tests.support.uvicorn_thread import running

pytestmark = pytest.mark.slow

XSS_TEXT = '<script>window.__xss=1</script> and <img src=x onerror="window.__xss=1"> done'
XSS_ARGUMENTS = {"q": "<img src=x onerror=window.__xss=3><script>window.__xss=3</script>"}
XSS_MODEL = "<img src=x onerror=window.__xss=4>"
KEY = "sk-console-browser"


def by_id(driver: Any, element_id: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def all_of(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    with infer_serve("--max-batch-size", "4") as url:
        yield url


async def two_replicas() -> list[dict[str, Any]]:
    """A fleet's replicas as ``/admin/replicas`` lists them, each with its last second."""
    second = int(time.time()) - 1
    return [
        {
            "id": f"replica-{i}",
            "pid": 100 + i,
            "node": XSS_MODEL,
            "state": "running",
            "running": i + 1,
            "waiting": 0,
            "kv_usage": 0.1 * (i + 1),
            "prefix_hit_rate": 0.5,
            "healthy": True,
            "step": {"t": second, "generation_tps": 10 * (i + 1), "prompt_tps": 0, "ttft_s": 0.1},
        }
        for i in range(2)
    ]


@contextmanager
def fake_server(tmp_path: Path, *, keys: bool = False, fleet: bool = False) -> Iterator[str]:
    """The server's app on the fake model in this process: every answer is ``XSS_TEXT``
    then a tool call with ``XSS_ARGUMENTS``; served as ``XSS_MODEL``; ``keys``: with a keys
    file; ``fleet``: as a fleet's ingress with :func:`two_replicas`."""
    call = json.dumps({"name": "lookup", "arguments": XSS_ARGUMENTS})
    answer = f"{XSS_TEXT}<tool_call>{call}</tool_call>"
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), answer), step_latency_s=0.005)
    overrides: dict[str, Any] = {"cache_dir": str(tmp_path), "served_model_name": XSS_MODEL}
    if keys:
        keys = tmp_path / "keys.json"
        keys.write_text(json.dumps({"tenants": [{"id": "alice", "keys": [hash_key(KEY)]}]}))
        overrides["api_keys_file"] = str(keys)
    container = fake_container(runner, **overrides)
    if fleet:
        container.replicas.override(providers.Object(two_replicas))
    app = container.http_app()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    with running(server) as live:
        yield live.url


def open_console(driver: Any, url: str) -> None:
    driver.get(f"{url}/")
    wait_for(driver, lambda d: all_of(d, "#pg-model option"))


def record_streaming(driver: Any) -> None:
    """Note every length the assistant's text takes in the page (window.__lengths)."""
    driver.execute_script(
        """
        window.__lengths = [];
        const box = document.getElementById('pg-messages');
        new MutationObserver(() => {
          const content = box.querySelector('.message.assistant .content');
          if (content) window.__lengths.push(content.textContent.length);
        }).observe(box, {subtree: true, childList: true, characterData: true});
        """
    )


def chat(driver: Any, text: str) -> None:
    prompt = by_id(driver, "pg-prompt")
    prompt.clear()
    prompt.send_keys(text)
    by_id(driver, "pg-send").click()


def finished(driver: Any) -> bool:
    metas = all_of(driver, ".message.assistant .meta")
    return bool(metas) and "finish:" in metas[-1].get_attribute("textContent")


def test_a_chat_streams_into_the_playground(browser: Any, served: str) -> None:
    open_console(browser, served)
    max_tokens = by_id(browser, "pg-max_tokens")
    max_tokens.clear()
    max_tokens.send_keys("96")
    record_streaming(browser)
    chat(browser, "Write a haiku about the sea.")
    wait_for(browser, finished, timeout_s=120)
    text = all_of(browser, ".message.assistant .content")[-1].get_attribute("textContent")
    assert text.strip()
    lengths = [n for n in browser.execute_script("return window.__lengths") if n]
    assert len(set(lengths)) > 3, f"the text came at once: {lengths}"
    assert lengths == sorted(lengths)
    save_screenshot(browser, "console_playground")
    assert not console_errors(browser)


def test_the_running_counter_moves_under_load(browser: Any, served: str) -> None:
    browser.get(f"{served}/#engine")
    wait_for(browser, lambda d: "KV blocks" in by_id(d, "engine-status").text)
    wait_for(browser, lambda d: by_id(d, "engine-running").text == "0")
    model = httpx.get(f"{served}/v1/models").json()["data"][0]["id"]

    def slow() -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{served}/v1/chat/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=slow) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        wait_for(browser, lambda d: int(by_id(d, "engine-running").text or 0) >= 2, 60)
        wait_for(browser, lambda d: float(by_id(d, "engine-gen").text or 0) > 0, 30)
        time.sleep(2)  # a few points on the charts
        save_screenshot(browser, "console_engine")
    finally:
        for thread in threads:
            thread.join(timeout=120)
    wait_for(browser, lambda d: by_id(d, "engine-running").text == "0", 30)
    assert not console_errors(browser)


def test_every_tab_loads_without_breaking_the_csp(browser: Any, served: str) -> None:
    page = httpx.get(f"{served}/")
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert page.headers["x-content-type-options"] == "nosniff"
    for tab in ("playground", "engine", "tenants", "rollouts", "models", "audit", "training"):
        browser.get(f"{served}/#{tab}")
        wait_for(browser, lambda d, tab=tab: all_of(d, f"section.tab-{tab} *"))
        time.sleep(0.5)
        errors = console_errors(browser)
        assert not [e for e in errors if "Content Security Policy" in e], errors


def test_model_output_tool_calls_and_names_stay_text(browser: Any, tmp_path: Path) -> None:
    with fake_server(tmp_path) as url:
        check_xss(browser, url)


def check_xss(browser: Any, url: str) -> None:
    open_console(browser, url)
    assert by_id(browser, "pg-model").get_attribute("value") == XSS_MODEL
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    browser.execute_script(
        "document.querySelector('#pg-tools').closest('details').open = true;"
        "document.getElementById('pg-tools').value = arguments[0];",
        json.dumps(tools),
    )
    chat(browser, "Hello")
    wait_for(browser, finished)
    content = all_of(browser, ".message.assistant .content")[-1].get_attribute("textContent")
    assert XSS_TEXT in content
    (call,) = all_of(browser, ".message.assistant .tool-call")
    assert call.find_element("css selector", ".name").text == "lookup"
    assert json.loads(call.find_element("css selector", "pre").text) == XSS_ARGUMENTS
    label = all_of(browser, ".message.assistant .role")[-1].get_attribute("textContent")
    assert label == XSS_MODEL
    assert not all_of(browser, "#page img, #page script")
    time.sleep(0.5)  # an onerror would have fired by now
    assert browser.execute_script("return window.__xss") is None
    save_screenshot(browser, "console_xss")


def test_the_page_asks_for_a_key_and_keeps_it_in_the_tab(browser: Any, tmp_path: Path) -> None:
    with fake_server(tmp_path, keys=True) as url:
        check_key_prompt(browser, url)


def check_key_prompt(browser: Any, fake_server: str) -> None:
    browser.get(f"{fake_server}/")
    wait_for(browser, lambda d: all_of(d, "#key-form"))
    key = by_id(browser, "api-key")
    key.send_keys("sk-wrong")
    key.submit()
    wait_for(browser, lambda d: "invalid API key" in by_id(d, "key-error").text)
    key = by_id(browser, "api-key")
    key.clear()
    key.send_keys(KEY)
    key.submit()
    wait_for(browser, lambda d: all_of(d, "#pg-model option"))
    stored = browser.execute_script("return sessionStorage.getItem('infer.console.key')")
    assert stored == KEY
    assert browser.execute_script("return localStorage.length") == 0
    chat(browser, "Hello")
    wait_for(browser, finished)
    browser.get(f"{fake_server}/#engine")  # a reload keeps the key (same tab)
    wait_for(browser, lambda d: "KV blocks" in by_id(d, "engine-status").text)
    by_id(browser, "forget-key").click()
    wait_for(browser, lambda d: all_of(d, "#key-form"))
    assert browser.execute_script("return sessionStorage.getItem('infer.console.key')") is None


def test_a_fleet_is_shown_per_replica(browser: Any, tmp_path: Path) -> None:
    with fake_server(tmp_path, fleet=True) as url:
        browser.get(f"{url}/#engine")
        wait_for(browser, lambda d: "2 replicas" in by_id(d, "engine-status").text)
        wait_for(browser, lambda d: by_id(d, "engine-running").text == "3")  # 1 + 2
        wait_for(browser, lambda d: by_id(d, "engine-gen").text == "30")
        rows = all_of(browser, "#engine-replica-table tbody tr")
        assert [r.find_element("css selector", "td").text for r in rows] == [
            "replica-0",
            "replica-1",
        ]
        assert rows[0].find_elements("css selector", "td")[2].text == XSS_MODEL
        assert not all_of(browser, "#page img")
        save_screenshot(browser, "console_fleet")
        assert browser.execute_script("return window.__xss") is None

"""The console's tenants and training pages in headless Chromium against a real
`infer serve` with a keys file and the Tinker API: a Tinker run's loss curve gains points
as it trains, its sampler checkpoint is sampled in the playground with one click, an admin
key sees the tenants, their limits (the daily quotas too), their usage and their last 7
days (the usage API's buckets as bars), and a key without the admin face is refused.
Screenshots go to the test artifacts (``tests/e2e/browser.py``)."""

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from application.access.keys import hash_key
from tests.e2e.browser import browser, console_errors, save_screenshot, wait_for
from tests.e2e.console_page import use_key
from tests.e2e.server import infer_serve
from tests.support.tinker_client import Api

pytestmark = pytest.mark.slow
os.environ.setdefault("TINKER_TELEMETRY", "0")
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
OPS_KEY = "sk-ops-console"  # faces openai, tinker, admin
ALICE_KEY = "sk-alice-console"  # faces openai, tinker
HOSTILE_KEY = "sk-hostile-console"
# A tenant id is the operator's text, shown as text: never markup that runs.
HOSTILE = '<img src=x onerror="window.__owned = 1"><script>window.__owned = 2</script>'
__all__ = ["browser"]  # the fixture, used by name


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("console")
    keys = folder / "keys.json"
    tenants = [
        {"id": "ops", "keys": [hash_key(OPS_KEY)], "faces": ["openai", "tinker", "admin"]},
        {
            "id": "alice",
            "keys": [hash_key(ALICE_KEY)],
            "requests_per_minute": 600,
            "requests_per_day": 1000,
            "tokens_per_day": 50000,
        },
        {"id": HOSTILE, "keys": [hash_key(HOSTILE_KEY)]},
    ]
    keys.write_text(json.dumps({"tenants": tenants}))
    flags = (
        *("--api-keys-file", str(keys), "--checkpoint-dir", str(folder / "checkpoints")),
        *("--usage-db", str(folder / "usage.sqlite3")),  # this module's usage only
    )
    with infer_serve(*flags) as url:
        yield url


class Trainer:
    """A Tinker run driven over plain HTTP (cross entropy on a fixed sequence)."""

    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=120)
        self.api = Api(self.http, {"X-API-Key": key})
        self.model_id = self.api.model(self.api.session(), base_model=MODEL)
        self.seq = 1

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.api.result(self.api.forward_backward(self.model_id, self.seq))
            adam = {"learning_rate": 1e-3}
            body = {"model_id": self.model_id, "seq_id": self.seq + 1, "adam_params": adam}
            self.api.run("optim_step", body)
            self.seq += 2

    def save_for_sampler(self, name: str) -> str:
        body = {"model_id": self.model_id, "path": name, "seq_id": self.seq}
        self.seq += 1
        path: str = self.api.run("save_weights_for_sampler", body)["path"]
        return path


def curve_points(driver: Any) -> int:
    from selenium.webdriver.common.by import By

    boxes = driver.find_elements(By.ID, "run-curve")
    return int(boxes[0].get_attribute("data-points") or 0) if boxes else -1


def test_a_runs_curve_gains_points_and_its_checkpoint_is_sampled(browser: Any, server: str) -> None:
    from selenium.webdriver.common.by import By

    trainer = Trainer(server, OPS_KEY)
    trainer.steps(2)
    use_key(browser, server, OPS_KEY, "training")
    run_row = f'#runs-table tr[data-run="{trainer.model_id}"]'
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, run_row))
    wait_for(browser, lambda d: curve_points(d) == 2)
    trainer.steps(3)  # the page polls: the curve grows while it is shown
    wait_for(browser, lambda d: curve_points(d) == 5)
    assert browser.find_element(By.ID, "metric-select").get_attribute("value") == "loss:sum"
    steps_text = browser.find_element(By.ID, "curve-steps").text
    assert "5 point(s)" in steps_text and "step 4" in steps_text

    path = trainer.save_for_sampler("console")
    button_css = f'#checkpoints-table tr[data-path="{path}"] button.sample-button'
    button = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, button_css))[0]
    assert button.is_enabled()
    row = browser.find_element(By.CSS_SELECTOR, f'#checkpoints-table tr[data-path="{path}"]')
    assert "sampler" in row.text and "MiB" in row.text and "never" in row.text
    save_screenshot(browser, "console-training")

    button.click()  # one click: the playground, on the checkpoint
    wait_for(browser, lambda d: d.find_elements(By.ID, "pg-model"))
    wait_for(browser, lambda d: d.find_element(By.ID, "pg-model").get_attribute("value") == path)
    browser.find_element(By.ID, "pg-prompt").send_keys("Hello")
    browser.find_element(By.ID, "pg-send").click()
    reply = ".message.assistant .meta"
    wait_for(browser, lambda d: [m for m in d.find_elements(By.CSS_SELECTOR, reply) if m.text])
    assert not browser.find_elements(By.CSS_SELECTOR, ".message.assistant .meta .error")
    assert console_errors(browser) == []


# The "Last 7 days" panel's rows, read in one script (the page redraws it every 5 s).
WEEK_ROWS_JS = """
return [...document.querySelectorAll('#usage-week-table tbody tr')].map((row) => ({
  cells: [...row.cells].map((c) => c.textContent),
  requests: row.dataset.requests,
  bars: [...row.querySelectorAll('.bars.requests .bar')].map((b) => ({
    classes: b.className, value: b.dataset.value, title: b.title })),
}));
"""


def week_rows(driver: Any) -> dict[str, dict[str, Any]]:
    """The "Last 7 days" rows by the tenant as shown (the first cell's text)."""
    return {row["cells"][0]: row for row in driver.execute_script(WEEK_ROWS_JS)}


def week_requests(driver: Any, name: str) -> int:
    row = week_rows(driver).get(name)
    return int(row["requests"]) if row else -1


def test_the_tenants_page_for_an_admin_key_and_not_for_others(browser: Any, server: str) -> None:
    from selenium.webdriver.common.by import By

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    for key in (ALICE_KEY, ALICE_KEY, HOSTILE_KEY):
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.post(f"{server}/v1/chat/completions", json=body, headers=headers).is_success

    use_key(browser, server, OPS_KEY, "tenants")
    rows = "#tenants-table tr[data-tenant]"
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, rows)) == 3)
    alice = browser.find_element(By.CSS_SELECTOR, '#tenants-table tr[data-tenant="alice"]')
    cells = [c.text for c in alice.find_elements(By.TAG_NAME, "td")]
    assert cells[0] == "alice" and "600 req/min" in cells[4]
    assert "1,000 req/day" in cells[4] and "50,000 tokens/day" in cells[4]  # daily quotas
    assert int(cells[5]) >= 1  # her requests today
    ops = browser.find_element(By.CSS_SELECTOR, '#tenants-table tr[data-tenant="ops"]')
    assert "admin" in ops.text
    ops_limits = ops.find_elements(By.TAG_NAME, "td")[4].text
    assert ops_limits == "unlimited"  # no daily quota: nothing shown for it
    names = [
        r.find_element(By.TAG_NAME, "td").text for r in browser.find_elements(By.CSS_SELECTOR, rows)
    ]
    assert HOSTILE in names  # the id as text

    # The last 7 days: the usage API's buckets (recorded in the background, so polled).
    wait_for(browser, lambda d: week_requests(d, "alice") == 2)
    week = week_rows(browser)
    assert {"alice", "ops", HOSTILE} <= set(week)  # every tenant, the hostile id as text
    alice_week = week["alice"]
    assert alice_week["cells"][4] == "2" and int(alice_week["cells"][2].replace(",", "")) > 2 * 3
    bars = alice_week["bars"]
    assert len(bars) == 7  # a bar per UTC day, today's last
    assert bars[-1]["value"] == "2" and "h20" in bars[-1]["classes"].split()  # the busiest
    assert bars[-1]["title"].endswith(": 2 requests")
    assert all(bar["value"] == "0" and "h0" in bar["classes"].split() for bar in bars[:-1])
    assert week[HOSTILE]["requests"] == "1"
    assert "UTC days" in browser.find_element(By.ID, "usage-week-range").text
    assert browser.execute_script("return window.__owned") is None
    hostile_markup = (
        "#tenants-table img, #tenants-table script, #usage-week img, #usage-week script"
    )
    assert not browser.find_elements(By.CSS_SELECTOR, hostile_markup)
    save_screenshot(browser, "console-tenants")

    # The usage API unreachable: the panel says so, as text; the tenants table stays.
    browser.execute_cdp_cmd("Network.enable", {})
    blocked = {"urls": ["*/v1/organization/usage/*"]}
    browser.execute_cdp_cmd("Network.setBlockedURLs", blocked)
    week_error = wait_for(browser, lambda d: d.find_element(By.ID, "usage-week-error").text)
    assert "last 7 days is not available" in week_error
    assert not browser.find_elements(By.ID, "usage-week-table")
    assert browser.find_elements(By.CSS_SELECTOR, rows)
    browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})
    wait_for(browser, lambda d: d.find_elements(By.ID, "usage-week-table"))
    assert browser.find_element(By.ID, "usage-week-error").text == ""

    browser.find_element(By.ID, "forget-key").click()
    use_key(browser, server, ALICE_KEY, "tenants")
    error = wait_for(browser, lambda d: d.find_element(By.ID, "tenants-error").text)
    assert "admin" in error
    assert not browser.find_elements(By.ID, "tenants-table")
    assert not browser.find_elements(By.ID, "usage-week-table")
    assert not browser.find_element(By.ID, "usage-week").is_displayed()
    browser.get(f"{server}/#training")  # her own runs only: none
    wait_for(browser, lambda d: d.find_elements(By.ID, "training-empty"))


def test_an_open_server_samples_a_checkpoint_once_its_tinker_key_is_set(
    browser: Any, tmp_path: Path
) -> None:
    # No keys file: the console needs no key, but a checkpoint is its saver's to sample
    # (unless published): "Set key" gives the page the Tinker key, for this tab only.
    from selenium.webdriver.common.by import By

    key = "tml-console-open"
    with infer_serve("--checkpoint-dir", str(tmp_path / "checkpoints")) as url:
        trainer = Trainer(url, key)
        trainer.steps(1)
        path = trainer.save_for_sampler("open")
        browser.get(f"{url}/#training")
        button_css = f'#checkpoints-table tr[data-path="{path}"] button.sample-button'
        button = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, button_css))[0]
        assert not button.is_enabled() and "Set key" in (button.get_attribute("title") or "")
        browser.find_element(By.ID, "set-key").click()
        field = wait_for(browser, lambda d: d.find_elements(By.ID, "api-key"))[0]
        field.send_keys(key)
        browser.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()
        button = wait_for(
            browser,
            lambda d: [b for b in d.find_elements(By.CSS_SELECTOR, button_css) if b.is_enabled()],
        )[0]
        assert browser.find_elements(By.ID, "forget-key")
        button.click()
        wait_for(
            browser, lambda d: d.find_element(By.ID, "pg-model").get_attribute("value") == path
        )
        browser.find_element(By.ID, "pg-prompt").send_keys("Hello")
        browser.find_element(By.ID, "pg-send").click()
        reply = ".message.assistant .meta"
        wait_for(browser, lambda d: [m for m in d.find_elements(By.CSS_SELECTOR, reply) if m.text])
        assert not browser.find_elements(By.CSS_SELECTOR, ".message.assistant .meta .error")
        browser.find_element(By.ID, "forget-key").click()  # back to no key, no prompt
        wait_for(browser, lambda d: d.find_elements(By.ID, "set-key"))
        assert browser.execute_script("return sessionStorage.length") == 0

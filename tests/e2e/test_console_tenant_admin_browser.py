"""The console's tenant changes in headless Chromium against a real `infer serve` with a
keys file holding one admin tenant ("ops", one key): an admin creates a tenant with a
rate limit through the form, mints its key (shown once, in a box, stored nowhere) and
the key works until the limit (429), edits the limit, revokes the key (401), reads an API
error and the lock-out refusal as text, deletes the tenant; a hostile tenant id stays
text; a server without a keys file shows the admin API's 409 instead of the controls.
Screenshots go to the test artifacts (``tests/e2e/browser.py``)."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.e2e.browser import browser, save_screenshot, wait_for
from tests.e2e.console_page import PageItems, confirm, page_errors, press, retype, use_key
from tests.e2e.server import bearer_client, get_ok, infer_serve, keyed_serve

pytestmark = pytest.mark.slow
OPS_KEY = "sk-ops-tenant-admin"  # faces openai, admin: the only admin key
# A tenant id is the operator's text, shown as text: never markup that runs.
HOSTILE = "<img src=x onerror=window.__xss=1>"
LIMITS = (
    "requests_per_second",
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_streams",
    "requests_per_day",
    "tokens_per_day",
    "max_output_tokens",
)
__all__ = ["browser"]  # the fixture, used by name


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("tenant-admin")
    with keyed_serve(folder, {"ops": OPS_KEY}) as url:
        yield url


def tenants(url: str) -> dict[str, dict[str, Any]]:
    """``GET /admin/tenants`` by id."""
    return {t["id"]: t for t in get_ok(url, OPS_KEY, "/admin/tenants", 60)["data"]}


def served_model(url: str) -> str:
    return str(get_ok(url, OPS_KEY, "/v1/models", 60)["data"][0]["id"])


def complete(url: str, key: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "Hi", "max_tokens": 1}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


# The changes' table, read in one script (the page refreshes every 5 s): by tenant id,
# the name as shown, its key ids and the row's error.
ROWS_JS = """
return Object.fromEntries([...document.querySelectorAll('#tenant-admin-table tbody tr')].map(
  (row) => [row.dataset.tenant, {
    name: row.cells[0].textContent,
    keys: [...row.querySelectorAll('.key-list li[data-key]')].map((li) => li.dataset.key),
    error: row.querySelector('.tenant-admin-error').textContent,
  }]));
"""
ROWS = PageItems("#tenant-admin-table tbody tr", "tenant", ROWS_JS)


def fill(driver: Any, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, element_id)
    press(driver, field)
    retype(field, value)


def value(driver: Any, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.ID, element_id).get_attribute("value"))


def next_refresh(driver: Any) -> None:
    """Wait for the page's next refresh (its status line's time changes)."""
    from selenium.webdriver.common.by import By

    status = driver.find_element(By.ID, "tenants-status").text
    wait_for(driver, lambda d: d.find_element(By.ID, "tenants-status").text != status)


STORED_JS = """
const all = [];
for (const store of [sessionStorage, localStorage]) {
  for (let i = 0; i < store.length; i++) all.push(store.key(i) + '=' + store.getItem(store.key(i)));
}
return all.join('\\n');
"""


def test_an_admin_creates_keys_limits_and_deletes_a_tenant(browser: Any, server: str) -> None:
    from selenium.webdriver.common.by import By

    model = served_model(server)
    use_key(browser, server, OPS_KEY, "tenants")
    wait_for(browser, lambda d: "ops" in ROWS.read(d))
    assert ROWS.read(browser)["ops"]["keys"] == [tenants(server)["ops"]["keys"][0]["id"]]
    assert "admin" in ROWS.read(browser)["ops"]["name"]

    # A new tenant: the default faces, every model, weight 1, 2 requests a minute.
    assert value(browser, "tenant-form-weight") == "1"
    checked = browser.find_elements(By.CSS_SELECTOR, "#tenant-form .tenant-face:checked")
    assert {c.get_attribute("data-face") for c in checked} == {"openai", "tinker"}
    fill(browser, "tenant-form-id", "acme")
    fill(browser, "tenant-form-requests_per_minute", "2")
    press(browser, browser.find_element(By.ID, "tenant-form-save"))
    wait_for(browser, lambda d: "acme" in ROWS.read(d))
    acme = tenants(server)["acme"]
    assert acme["faces"] == ["openai", "tinker"] and acme["models"] is None
    assert acme["weight"] == 1.0 and acme["keys"] == [] and not acme["admin"]
    assert acme["limits"] == {name: 2 if name == "requests_per_minute" else None for name in LIMITS}
    assert "created" in browser.find_element(By.ID, "tenant-form-done").text
    assert value(browser, "tenant-form-id") == ""  # the form is a new tenant's again
    assert browser.find_element(By.ID, "tenant-form-error").text == ""
    # The same id again is refused by the page (a PUT would replace its settings).
    fill(browser, "tenant-form-id", "ops")
    press(browser, browser.find_element(By.ID, "tenant-form-save"))
    assert "exists already" in browser.find_element(By.ID, "tenant-form-error").text
    press(browser, browser.find_element(By.ID, "tenant-form-cancel"))

    # A key: shown once in the box, with a note; it answers until the limit, then 429.
    press(browser, ROWS.element(browser, "acme", "button.new-key"))
    box = wait_for(browser, lambda d: d.find_element(By.ID, "tenant-new-key-value").text)
    key = str(box)
    assert key.startswith("sk-infer-")
    note = browser.find_element(By.ID, "tenant-new-key-note").text
    assert "will not be shown again" in note
    key_id = tenants(server)["acme"]["keys"][0]["id"]
    wait_for(browser, lambda d: ROWS.read(d)["acme"]["keys"] == [key_id])
    assert key not in browser.execute_script(STORED_JS)  # never stored
    press(browser, browser.find_element(By.ID, "tenant-new-key-copy"))
    wait_for(browser, lambda d: d.find_element(By.ID, "tenant-new-key-copied").text)
    save_screenshot(browser, "console-tenant-admin")
    for _ in range(2):
        answer = complete(server, key, model)
        assert answer.status_code == 200, answer.text
    assert complete(server, key, model).status_code == 429  # the third within the minute
    press(browser, browser.find_element(By.ID, "tenant-new-key-dismiss"))
    assert not browser.find_element(By.ID, "tenant-new-key").is_displayed()
    next_refresh(browser)  # the refresh never shows it again
    assert key not in browser.execute_script("return document.body.textContent")
    assert key not in browser.execute_script(STORED_JS)

    # Edit: the form prefilled from the admin API; a value typed survives the refresh.
    press(browser, ROWS.element(browser, "acme", "button.edit-tenant"))
    assert "acme" in browser.find_element(By.ID, "tenant-form-title").text
    assert value(browser, "tenant-form-id") == "acme"
    assert browser.find_element(By.ID, "tenant-form-id").get_attribute("readonly") is not None
    assert value(browser, "tenant-form-requests_per_minute") == "2"
    assert value(browser, "tenant-form-tokens_per_day") == ""
    fill(browser, "tenant-form-requests_per_minute", "10")
    browser.execute_script("document.activeElement.blur()")
    next_refresh(browser)
    assert value(browser, "tenant-form-requests_per_minute") == "10"
    press(browser, browser.find_element(By.ID, "tenant-form-save"))
    wait_for(browser, lambda d: tenants(server)["acme"]["limits"]["requests_per_minute"] == 10)
    acme = tenants(server)["acme"]
    assert acme["faces"] == ["openai", "tinker"] and acme["weight"] == 1.0  # the rest kept
    assert acme["keys"] == [{"id": key_id}]
    assert "saved" in browser.find_element(By.ID, "tenant-form-done").text

    # A bad value: the API's error as text, the tenant unchanged.
    press(browser, ROWS.element(browser, "acme", "button.edit-tenant"))
    fill(browser, "tenant-form-weight", "0")
    press(browser, browser.find_element(By.ID, "tenant-form-save"))
    error = wait_for(browser, lambda d: d.find_element(By.ID, "tenant-form-error").text)
    assert "positive" in error and "weight" in error
    assert tenants(server)["acme"]["weight"] == 1.0
    press(browser, browser.find_element(By.ID, "tenant-form-cancel"))
    assert value(browser, "tenant-form-id") == ""

    # Revoke, after confirm(): dismissed, nothing happens; accepted, the key is refused.
    revoke = f'button.revoke-key[data-key="{key_id}"]'
    confirm(browser, ROWS.element(browser, "acme", revoke), accept=False)
    assert tenants(server)["acme"]["keys"] == [{"id": key_id}]
    assert key_id in confirm(browser, ROWS.element(browser, "acme", revoke), accept=True)
    wait_for(browser, lambda d: ROWS.read(d)["acme"]["keys"] == [])
    assert tenants(server)["acme"]["keys"] == []
    assert complete(server, key, model).status_code == 401

    # The last admin key cannot go: the API's refusal, as text in its row.
    ops_key = ROWS.read(browser)["ops"]["keys"][0]
    revoke = f'button.revoke-key[data-key="{ops_key}"]'
    confirm(browser, ROWS.element(browser, "ops", revoke), accept=True)
    locked = wait_for(browser, lambda d: ROWS.read(d)["ops"]["error"])
    assert "locked out" in locked
    assert tenants(server)["ops"]["keys"] == [{"id": ops_key}]
    next_refresh(browser)
    assert "locked out" in ROWS.read(browser)["ops"]["error"]  # kept until the next action

    # Delete, after confirm().
    assert "acme" in confirm(
        browser, ROWS.element(browser, "acme", "button.delete-tenant"), accept=True
    )
    wait_for(browser, lambda d: "acme" not in ROWS.read(d))
    assert "acme" not in tenants(server)
    assert page_errors(browser) == []


def test_a_hostile_tenant_id_is_text(browser: Any, server: str) -> None:
    from selenium.webdriver.common.by import By

    with bearer_client(server, OPS_KEY, 60) as http:
        put = http.put(f"/admin/tenants/{quote(HOSTILE, safe='')}", json={"weight": 2})
        assert put.status_code == 201, put.text
    use_key(browser, server, OPS_KEY, "tenants")
    wait_for(browser, lambda d: HOSTILE in ROWS.read(d))
    assert ROWS.read(browser)[HOSTILE]["name"] == HOSTILE  # the id as text
    press(browser, ROWS.element(browser, HOSTILE, "button.edit-tenant"))
    assert HOSTILE in browser.find_element(By.ID, "tenant-form-title").text
    assert value(browser, "tenant-form-weight") == "2"
    press(browser, browser.find_element(By.ID, "tenant-form-cancel"))
    assert browser.execute_script("return window.__xss") is None
    assert not browser.find_elements(By.CSS_SELECTOR, "#tenant-admin img, #tenants-table img")
    # Its buttons work on the id as it is (sent percent-encoded).
    confirm(browser, ROWS.element(browser, HOSTILE, "button.delete-tenant"), accept=True)
    wait_for(browser, lambda d: HOSTILE not in ROWS.read(d))
    assert HOSTILE not in tenants(server)
    assert browser.execute_script("return window.__xss") is None
    assert page_errors(browser) == []


def test_without_a_keys_file_the_409_is_shown_instead_of_the_controls(
    browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    with infer_serve("--usage-db", str(tmp_path / "usage.sqlite3")) as url:
        browser.get(f"{url}/#tenants")
        notice = wait_for(browser, lambda d: d.find_elements(By.ID, "tenant-admin-unavailable"))
        assert "--api-keys-file" in notice[0].text
        assert browser.find_elements(By.ID, "tenants-open")  # the page's own notice stays
        for control in ("tenant-admin-table", "tenant-form", "tenant-admin-controls"):
            assert not browser.find_elements(By.ID, control)
        next_refresh(browser)  # shown once: not asked again, not repeated
        assert len(browser.find_elements(By.ID, "tenant-admin-unavailable")) == 1
        assert page_errors(browser) == []

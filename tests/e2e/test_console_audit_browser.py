"""The console's audit page in headless Chromium against a real `infer serve` (the default
model served as ``base``, ``A`` and ``B``; a keys file; the usage database a file) whose
admin API is driven with httpx: the changes appear newest first with their actor, the
filter narrows them (and survives the refresh that brings a new one), "Load older" pages
back past the newest 100, a hostile rollout name and details stay text, and a key without
the admin face reads the 403's message. Screenshots go to the test artifacts
(``tests/e2e/browser.py``)."""

import re
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.e2e.browser import browser, save_screenshot, wait_for
from tests.e2e.console_page import page_errors, retype, use_key
from tests.e2e.server import bearer_client, get_ok, keyed_serve

pytestmark = pytest.mark.slow
OPS_KEY = "sk-ops-audit"  # faces openai, admin
ALICE_KEY = "sk-alice-audit"  # faces openai
# A rollout's name is the operator's text, shown as text: never markup that runs.
HOSTILE = "<img src=x onerror=window.__xss=1>"
REFRESH_S = 10
__all__ = ["browser"]  # the fixture, used by name


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("audit")
    keys = {"ops": OPS_KEY, "alice": ALICE_KEY}
    # The test's 130-odd changes log an audit, an access and a request line each: warnings
    # only keep the server's log small.
    flags = ("--served-model-name", "base", "A", "B", "--log-level", "warning")
    with keyed_serve(folder, keys, *flags) as url:
        yield url


def trail(url: str) -> list[dict[str, Any]]:
    """The whole trail from the API (``GET /admin/audit``, newest first)."""
    listed = get_ok(url, OPS_KEY, "/admin/audit", limit=1000)
    assert listed["has_more"] is False
    events: list[dict[str, Any]] = listed["data"]
    return events


def ok(response: httpx.Response) -> httpx.Response:
    assert response.is_success, response.text
    return response


# The table's rows as shown, read in one script (the page refreshes every 10 s).
ROWS_JS = """
return [...document.querySelectorAll('#audit-table tbody tr')].map((row) => ({
  at: Number(row.dataset.at),
  time: row.querySelector('.audit-time').textContent,
  event: row.querySelector('.audit-event').textContent,
  actor: row.querySelector('.audit-actor').textContent,
  subject: row.querySelector('.audit-subject').textContent,
  details: row.querySelector('.audit-details').textContent,
  warning: row.classList.contains('warning'),
}));
"""


def rows(driver: Any) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = driver.execute_script(ROWS_JS)
    return result


def row_count(n: int) -> Callable[[Any], bool]:
    """A wait's condition: ``n`` rows shown."""
    return lambda driver: len(rows(driver)) == n


def shown(events: list[dict[str, Any]]) -> list[tuple[float, str, str]]:
    """Events (the API's or the page's rows) as (at, event, subject): order and identity."""
    return [(e["at"], e["event"], e["subject"]) for e in events]


def set_filter(driver: Any, text: str) -> None:
    from selenium.webdriver.common.by import By

    retype(driver.find_element(By.ID, "audit-filter"), text)


def test_an_admin_reads_the_changes_newest_first_and_filters_them(
    browser: Any, server: str
) -> None:
    from selenium.webdriver.common.by import By

    with bearer_client(server, OPS_KEY) as http:
        ok(http.put("/admin/tenants/acme", json={"weight": 2}))
        key_id = ok(http.post("/admin/tenants/acme/keys")).json()["id"]
        rollout = {"targets": [{"model": "A", "weight": 9}, {"model": "B", "weight": 1}]}
        ok(http.put("/admin/rollouts/support", json=rollout))
        ok(http.delete("/admin/rollouts/support"))
    expected = trail(server)
    assert [e["event"] for e in expected[:4]] == [
        "rollout removed",
        "rollout set",
        "api key created",
        "tenant created",
    ]

    use_key(browser, server, OPS_KEY, "audit")
    wait_for(browser, lambda d: len(rows(d)) == len(expected))
    table = rows(browser)
    assert shown(table) == shown(expected)  # newest first, each once
    newest = table[:4]
    assert [r["actor"] for r in newest] == ["ops"] * 4
    assert [r["subject"] for r in newest] == ["rollout:support"] * 2 + ["tenant:acme"] * 2
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", r["time"]) for r in table)
    assert 'targets: {"A":9,"B":1}' in newest[1]["details"]
    assert "rollout: support" in newest[1]["details"] and "before: null" in newest[1]["details"]
    assert f"key_id: {key_id}" in newest[2]["details"]
    assert "tenant: acme" in newest[3]["details"] and "weight: 2" in newest[3]["details"]
    assert not any(r["warning"] for r in table)
    assert browser.find_element(By.ID, "audit-error").text == ""
    assert not browser.find_element(By.ID, "audit-older").is_displayed()  # all of them shown
    save_screenshot(browser, "console-audit")

    # The filter narrows the rows shown to the rollout's (a substring of any field).
    set_filter(browser, "rollout")
    wait_for(browser, lambda d: len(rows(d)) == 2)
    assert [r["event"] for r in rows(browser)] == ["rollout removed", "rollout set"]
    assert "2 of" in browser.find_element(By.ID, "audit-status").text
    set_filter(browser, "ROLLOUT:SUPPORT")  # case-insensitive, the subject too
    assert len(rows(browser)) == 2
    set_filter(browser, "no such thing")
    assert rows(browser) == []
    assert "matches" in browser.find_element(By.ID, "audit-empty").text

    # A change made meanwhile appears at the next refresh (every 10 s), the filter kept,
    # nothing twice.
    set_filter(browser, "acme")
    before = len(rows(browser))
    with bearer_client(server, OPS_KEY) as http:
        ok(http.put("/admin/tenants/acme", json={"weight": 3}))
    wait_for(browser, lambda d: len(rows(d)) == before + 1, timeout_s=REFRESH_S + 10)
    assert browser.find_element(By.ID, "audit-filter").get_attribute("value") == "acme"
    top = rows(browser)[0]
    assert (top["event"], top["actor"], top["subject"]) == ("tenant updated", "ops", "tenant:acme")
    assert all("acme" in " ".join((r["subject"], r["details"])) for r in rows(browser))
    set_filter(browser, "")
    assert shown(rows(browser)) == shown(trail(server))
    assert page_errors(browser) == []


def test_load_older_pages_back_past_the_newest_hundred(browser: Any, server: str) -> None:
    from selenium.webdriver.common.by import By

    with bearer_client(server, OPS_KEY) as http:
        for weight in range(1, 121):
            ok(http.put("/admin/tenants/bulk", json={"weight": weight}))
    expected = trail(server)
    assert len(expected) > 120

    use_key(browser, server, OPS_KEY, "audit")
    wait_for(browser, lambda d: len(rows(d)) == 100)
    assert shown(rows(browser)) == shown(expected[:100])
    assert rows(browser)[0]["details"].endswith("weight: 120; limits: {}")
    older = browser.find_element(By.ID, "audit-older")
    assert older.is_displayed()
    assert "older ones on the server" in browser.find_element(By.ID, "audit-status").text
    pages = -(-len(expected) // 100)
    for page in range(2, pages + 1):
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", older)
        older.click()
        wait_for(browser, row_count(min(page * 100, len(expected))))
    assert shown(rows(browser)) == shown(expected)  # in order, none twice, none missing
    wait_for(browser, lambda d: not d.find_element(By.ID, "audit-older").is_displayed())
    # The filter works over the older pages too: every bulk update, and the first one.
    set_filter(browser, "tenant:bulk")
    assert len(rows(browser)) == 120
    assert rows(browser)[-1]["event"] == "tenant created"
    assert page_errors(browser) == []


def test_a_hostile_name_is_text_and_other_keys_are_refused(browser: Any, server: str) -> None:
    from selenium.webdriver.common.by import By

    with bearer_client(server, OPS_KEY) as http:
        body = {"targets": [{"model": "A", "weight": 1, "tenants": ["<b>alice</b>"]}]}
        ok(http.put(f"/admin/rollouts/{quote(HOSTILE, safe='')}", json=body))
        ok(http.delete(f"/admin/rollouts/{quote(HOSTILE, safe='')}"))

    use_key(browser, server, OPS_KEY, "audit")
    wait_for(browser, lambda d: rows(d) and rows(d)[0]["event"] == "rollout removed")
    removed, hostile = rows(browser)[:2]
    assert removed["subject"] == hostile["subject"] == f"rollout:{HOSTILE}"
    assert f"rollout: {HOSTILE}" in hostile["details"]
    assert 'pinned: {"A":["<b>alice</b>"]}' in hostile["details"]
    assert browser.execute_script("return window.__xss") is None
    assert not browser.find_elements(By.CSS_SELECTOR, "#audit-table img, #audit-table b")
    set_filter(browser, "<b>alice")
    assert [r["event"] for r in rows(browser)] == ["rollout set"]

    # Events that say "rolled back" stand out (an automatic rollback: rendered by the page's
    # own row builder, the server's rollback needing a failing target).
    script = """
    const done = arguments[arguments.length - 1];
    import('/ui/static/audit.js').then((m) => {
      const row = m.eventRow({at: 1764250000.5, event: 'rollout target rolled back',
        actor: 'automatic', subject: 'rollout:support',
        details: {target: 'B', error_rate: 0.5, requests: 40}});
      const quiet = m.eventRow({at: 1764250000.5, event: 'api keys reloaded', actor: null,
        subject: 'keys', details: {}});
      done([row.className, row.cells[2].textContent, row.cells[4].textContent,
            quiet.className, quiet.cells[2].textContent]);
    }, (e) => done(String(e)));
    """
    built = browser.execute_async_script(script)
    assert built == [
        "audit-row warning",
        "automatic",
        "target: B; error_rate: 0.5; requests: 40",
        "audit-row",
        "—",
    ]

    # A key without the admin face: the 403's message, no rows, no controls.
    browser.find_element(By.ID, "forget-key").click()
    use_key(browser, server, ALICE_KEY, "audit")
    error = wait_for(browser, lambda d: d.find_element(By.ID, "audit-error").text)
    assert "admin" in error
    assert rows(browser) == []
    assert not browser.find_element(By.ID, "audit-filter").is_displayed()
    assert not browser.find_element(By.ID, "audit-older").is_displayed()
    assert page_errors(browser) == []

"""The console's rollouts page in headless Chromium against a real `infer serve` (the
default model served as ``base``, ``A`` and ``B``; a rollout ``support`` = A:90, B:10 from
the flags) with a keys file: an admin key sees the rollout and its shares, moves B's
weight, rolls back to A, creates a rollout from the served models and deletes it, reads an
API error as text, and a hostile rollout name stays text; a key without the admin face is
refused. Screenshots go to the test artifacts (``tests/e2e/browser.py``)."""

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.browser import browser, save_screenshot, wait_for
from tests.e2e.console_page import PageItems, confirm, page_errors, press, retype, use_key
from tests.e2e.server import bearer_client, get_ok, keyed_serve

pytestmark = pytest.mark.slow
OPS_KEY = "sk-ops-rollouts"  # faces openai, admin
ALICE_KEY = "sk-alice-rollouts"  # faces openai
# A rollout's name is the operator's text, shown as text: never markup that runs.
HOSTILE = "<img src=x onerror=window.__xss=1>"
__all__ = ["browser"]  # the fixture, used by name


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("rollouts")
    flags = ("--served-model-name", "base", "A", "B", "--model-rollout", "support=A:90,B:10")
    with keyed_serve(folder, {"ops": OPS_KEY, "alice": ALICE_KEY}, *flags) as url:
        yield url


def rollouts(url: str) -> dict[str, dict[str, Any]]:
    """``GET /admin/rollouts`` by name."""
    return {r["name"]: r for r in get_ok(url, OPS_KEY, "/admin/rollouts")["data"]}


def weights(url: str, name: str) -> dict[str, float]:
    return {t["model"]: t["weight"] for t in rollouts(url)[name]["targets"]}


# The page's rollouts, read in one script (the page refreshes every 5 s): by name, the
# targets' shares as shown, the bar's segments, the inputs' weights, the error shown.
CARDS_JS = """
return Object.fromEntries([...document.querySelectorAll('#rollouts-list .rollout')].map((card) => [
  card.dataset.rollout, {
    title: card.querySelector('.rollout-name').textContent,
    targets: Object.fromEntries([...card.querySelectorAll('.rollout-targets tbody tr')].map(
      (row) => [row.dataset.model, {
        share: row.querySelector('td.share').textContent,
        weight: row.querySelector('input.weight-input').value,
        tenants: row.querySelector('td.tenants').textContent,
        recent: row.querySelector('td.recent').textContent,
      }])),
    segments: [...card.querySelectorAll('.share-bar .share-seg')].map((s) => ({
      model: s.dataset.model, classes: s.className.split(' ') })),
    policy: card.querySelector('.rollout-policy').textContent,
    error: card.querySelector('.rollout-error').textContent,
  }]));
"""
CARDS = PageItems("#rollouts-list .rollout", "rollout", CARDS_JS)


def weight_input(driver: Any, name: str, model: str) -> Any:
    return CARDS.element(driver, name, f'input.weight-input[data-model="{model}"]')


def set_weight(driver: Any, name: str, model: str, value: str) -> None:
    field = weight_input(driver, name, model)
    press(driver, field)
    retype(field, value)


def test_an_admin_moves_rolls_back_creates_and_deletes_rollouts(browser: Any, server: str) -> None:
    from selenium.webdriver.common.by import By

    use_key(browser, server, OPS_KEY, "rollouts")
    wait_for(browser, lambda d: "support" in CARDS.read(d))
    support = CARDS.read(browser)["support"]
    assert support["targets"]["A"]["share"] == "90 %" and support["targets"]["B"]["share"] == "10 %"
    assert support["targets"]["A"]["weight"] == "90" and support["targets"]["B"]["weight"] == "10"
    assert support["targets"]["A"]["tenants"] == "none"
    assert support["targets"]["A"]["recent"] == "–"  # no request through it yet
    for _ in range(3):  # one user: one target, its latest requests counted on the page
        answer = httpx.post(
            f"{server}/v1/chat/completions",
            json={
                "model": "support",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "user": "u1",
            },
            headers={"Authorization": f"Bearer {OPS_KEY}"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
    wait_for(
        browser,
        lambda d: (
            sorted(t["recent"] for t in CARDS.read(d)["support"]["targets"].values())
            == ["0 of 3 (0 %)", "–"]
        ),
    )
    segments = {s["model"]: s["classes"] for s in support["segments"]}
    assert "w90" in segments["A"] and "w10" in segments["B"]  # widths by class
    assert "25 %" in support["policy"] and "100 requests" in support["policy"]
    assert browser.find_element(By.ID, "rollouts-error").text == ""
    assert "No automatic rollback" in browser.find_element(By.CSS_SELECTOR, ".rollout").text
    save_screenshot(browser, "console-rollouts")

    # B's weight to 50: Save PUTs every target, the policy kept.
    save = CARDS.element(browser, "support", "button.save-weights")
    assert not save.is_enabled()  # nothing changed yet
    set_weight(browser, "support", "B", "50")
    assert save.is_enabled()
    press(browser, save)
    wait_for(browser, lambda d: weights(server, "support") == {"A": 90.0, "B": 50.0})
    assert rollouts(server)["support"]["rollback"] == {
        "max_error_rate": 0.25,
        "min_requests": 20,
        "window": 100,
    }
    wait_for(browser, lambda d: CARDS.read(d)["support"]["targets"]["B"]["share"] == "35.7 %")

    # A weight typed is kept while the page refreshes (every 5 s), until saved or discarded.
    set_weight(browser, "support", "A", "7")
    browser.execute_script("document.activeElement.blur()")
    status = browser.find_element(By.ID, "rollouts-status").text
    wait_for(browser, lambda d: d.find_element(By.ID, "rollouts-status").text != status)
    assert CARDS.read(browser)["support"]["targets"]["A"]["weight"] == "7"
    press(browser, CARDS.element(browser, "support", "button.reset-weights"))
    assert CARDS.read(browser)["support"]["targets"]["A"]["weight"] == "90"

    # An API error (a weight below 0) is shown as the error's message, the rollout unchanged.
    set_weight(browser, "support", "B", "-1")
    press(browser, CARDS.element(browser, "support", "button.save-weights"))
    error = wait_for(browser, lambda d: CARDS.read(d)["support"]["error"])
    assert "weight must be 0 or more" in error
    assert weights(server, "support") == {"A": 90.0, "B": 50.0}
    press(browser, CARDS.element(browser, "support", "button.reset-weights"))

    # Roll back to A: A weight 1, B 0.
    press(browser, CARDS.element(browser, "support", 'button.rollback-to[data-model="A"]'))
    wait_for(browser, lambda d: weights(server, "support") == {"A": 1.0, "B": 0.0})
    wait_for(browser, lambda d: CARDS.read(d)["support"]["targets"]["A"]["share"] == "100 %")
    assert CARDS.read(browser)["support"]["error"] == ""
    assert not CARDS.element(browser, "support", 'button.rollback-to[data-model="A"]').is_enabled()

    # A new rollout from the form: its targets are the served models, not the rollouts.
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#rollout-new-models input"))
    offered = {
        e.get_attribute("data-model")
        for e in browser.find_elements(By.CSS_SELECTOR, "#rollout-new-models .target-check")
    }
    assert {"base", "A", "B"} <= offered and "support" not in offered
    browser.find_element(By.ID, "rollout-new-name").send_keys("canary")
    for model, weight in (("A", "3"), ("B", "1")):
        row = f'#rollout-new-models .rollout-new-target[data-model="{model}"]'
        press(browser, browser.find_element(By.CSS_SELECTOR, f"{row} .target-check"))
        field = browser.find_element(By.CSS_SELECTOR, f"{row} .target-weight")
        field.clear()
        field.send_keys(weight)
    press(browser, browser.find_element(By.ID, "rollout-create"))
    wait_for(browser, lambda d: "canary" in CARDS.read(d))
    assert weights(server, "canary") == {"A": 3.0, "B": 1.0}
    canary = CARDS.read(browser)["canary"]
    assert canary["targets"]["A"]["share"] == "75 %" and canary["targets"]["B"]["share"] == "25 %"
    assert browser.find_element(By.ID, "rollout-create-error").text == ""
    # The same name again is refused by the page (a PUT would replace it).
    browser.find_element(By.ID, "rollout-new-name").send_keys("canary")
    press(browser, browser.find_element(By.CSS_SELECTOR, '.target-check[data-model="base"]'))
    press(browser, browser.find_element(By.ID, "rollout-create"))
    assert "exists already" in browser.find_element(By.ID, "rollout-create-error").text
    browser.find_element(By.ID, "rollout-new-name").clear()
    # An API error of the form: a rollout's name taken by a served model.
    browser.find_element(By.ID, "rollout-new-name").send_keys("B")
    press(browser, browser.find_element(By.ID, "rollout-create"))
    create_error = wait_for(browser, lambda d: d.find_element(By.ID, "rollout-create-error").text)
    assert "served model" in create_error

    # Delete, after confirm(): dismissed, nothing happens; accepted, it is gone.
    delete = "button.delete-rollout"
    confirm(browser, CARDS.element(browser, "canary", delete), accept=False)
    assert "canary" in rollouts(server) and "canary" in CARDS.read(browser)
    assert "canary" in confirm(browser, CARDS.element(browser, "canary", delete), accept=True)
    wait_for(browser, lambda d: "canary" not in CARDS.read(d))
    assert "canary" not in rollouts(server)
    assert page_errors(browser) == []


def test_a_hostile_name_is_text_and_other_keys_are_refused(browser: Any, server: str) -> None:
    from selenium.webdriver.common.by import By

    with bearer_client(server, OPS_KEY) as http:
        body = {"targets": [{"model": "A", "weight": 1, "tenants": ["<b>alice</b>"]}]}
        put = http.put(f"/admin/rollouts/{HOSTILE}", json=body)
        assert put.status_code == 200, put.text
    try:
        use_key(browser, server, OPS_KEY, "rollouts")
        wait_for(browser, lambda d: HOSTILE in CARDS.read(d))
        hostile = CARDS.read(browser)[HOSTILE]
        assert hostile["title"] == HOSTILE  # the name as text
        assert hostile["targets"]["A"]["tenants"] == "<b>alice</b>"
        assert browser.execute_script("return window.__xss") is None
        assert not browser.find_elements(By.CSS_SELECTOR, "#rollouts-list img, #rollouts-list b")
        # Its buttons work on the name as it is (sent percent-encoded).
        set_weight(browser, HOSTILE, "A", "2")
        press(browser, CARDS.element(browser, HOSTILE, "button.save-weights"))
        wait_for(browser, lambda d: weights(server, HOSTILE) == {"A": 2.0})
        assert rollouts(server)[HOSTILE]["targets"][0]["tenants"] == ["<b>alice</b>"]
        assert browser.execute_script("return window.__xss") is None
    finally:
        with bearer_client(server, OPS_KEY) as http:
            http.delete(f"/admin/rollouts/{HOSTILE}")

    # A key without the admin face: the 403's message, no rollout, no form.
    browser.find_element(By.ID, "forget-key").click()
    use_key(browser, server, ALICE_KEY, "rollouts")
    error = wait_for(browser, lambda d: d.find_element(By.ID, "rollouts-error").text)
    assert "admin" in error
    assert not browser.find_elements(By.CSS_SELECTOR, "#rollouts-list .rollout")
    assert not browser.find_element(By.ID, "rollout-new").is_displayed()
    assert page_errors(browser) == []

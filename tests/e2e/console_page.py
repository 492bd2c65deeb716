"""The console's pages in the headless browser (:mod:`tests.e2e.browser`): opened with a
key, their items found by name, inputs retyped, buttons pressed, the console's errors read."""

from dataclasses import dataclass
from typing import Any

from tests.e2e.browser import console_errors, wait_for


def use_key(driver: Any, url: str, key: str, tab: str) -> None:
    """Open the console on ``tab`` and give it ``key`` (the page asks for one)."""
    from selenium.webdriver.common.by import By

    driver.get(f"{url}/#{tab}")
    field = wait_for(driver, lambda d: d.find_elements(By.ID, "api-key"))[0]
    field.send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, f"section.tab-{tab}"))


def page_errors(driver: Any) -> list[str]:
    """The browser console's errors but the refused calls the test provokes (Chromium logs
    each 4xx answer as "Failed to load resource"): CSP violations, uncaught errors."""
    return [e for e in console_errors(driver) if "Failed to load resource" not in e]


def press(driver: Any, element: Any) -> None:
    """Click ``element``, scrolled to the middle first (the sticky header covers the top)."""
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
    element.click()


def retype(field: Any, text: str) -> None:
    """Replace what the input ``field`` holds with ``text``."""
    from selenium.webdriver.common.keys import Keys

    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.BACKSPACE)
    if text:
        field.send_keys(text)


def confirm(driver: Any, element: Any, accept: bool) -> str:
    """Press ``element`` and answer the ``confirm()`` it opens (OK or Cancel); its text."""
    press(driver, element)
    alert = driver.switch_to.alert
    text: str = alert.text
    if accept:
        alert.accept()
    else:
        alert.dismiss()
    return text


@dataclass(frozen=True)
class PageItems:
    """A list of things on a page (rollout cards, table rows): the selector ``css`` finds
    them, each named by its ``data-<key>``; ``script`` reads them all at once (the page
    refreshes itself), by name."""

    css: str
    key: str
    script: str

    def read(self, driver: Any) -> dict[str, dict[str, Any]]:
        result: dict[str, dict[str, Any]] = driver.execute_script(self.script)
        return result

    def element(self, driver: Any, name: str, css: str) -> Any:
        """The element ``css`` in the item ``name`` (found by script: a name may be any
        text)."""
        script = (
            f"return [...document.querySelectorAll('{self.css}')]"
            f".find((item) => item.dataset.{self.key} === arguments[0])"
            ".querySelector(arguments[1]);"
        )
        return driver.execute_script(script, name, css)

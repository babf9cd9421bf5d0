"""The dashboard's release comparison page in real headless Chromium: from the scenario page to the comparison of
the last two releases that served, their means and interval, one plot point per release in the order they served,
another pair chosen with the form, and no console error."""

from __future__ import annotations

import httpx
import pytest

from reef_core.testing.release_loop import TOKEN, release_loop

pytest.importorskip("selenium.webdriver")
from reef_core.testing.browser import chromium  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.expected_conditions import staleness_of  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


@pytest.fixture
def browser():
    yield from chromium("1280,1400")


def loaded(driver) -> None:
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")


def follow(driver, by: str, value: str) -> None:
    """Click what ``(by, value)`` finds on the loaded page and wait until the next page has loaded: an element found
    while a page still loads can be gone by the time it is clicked ("Node ... does not belong to the document",
    seen once in a CI run)."""
    loaded(driver)
    page = driver.find_element(By.TAG_NAME, "html")
    driver.find_element(by, value).click()
    WebDriverWait(driver, 30).until(staleness_of(page))
    loaded(driver)


def test_compare_page(tmp_path, fake_upstream_url, browser):
    with release_loop(tmp_path / "data", fake_upstream_url, scenario="cmp ui") as loop:
        first, second = loop.served
        browser.get(f"{loop.url}/ui/login")
        browser.find_element(By.NAME, "token").send_keys(TOKEN)
        follow(browser, By.CSS_SELECTOR, "button[type=submit]")
        follow(browser, By.LINK_TEXT, loop.scenario)
        follow(browser, By.LINK_TEXT, "compare releases")
        assert "Compare releases" in browser.title

        sides = {row.get_attribute("data-side"): row for row in browser.find_elements(By.CSS_SELECTOR, "tr.side")}
        assert sides["a"].find_element(By.CSS_SELECTOR, "code").text == first[:12]
        assert sides["b"].find_element(By.CSS_SELECTOR, "code").text == second[:12]
        assert [sides[k].find_element(By.CSS_SELECTOR, ".mean").text for k in "ab"] == ["0.250", "0.750"]
        api = httpx.get(f"{loop.url}/reef/scenarios/cmp%20ui/releases/compare", params={"a": first, "b": second},
                        headers={"authorization": f"Bearer {TOKEN}"}).json()["difference"]
        difference = browser.find_element(By.ID, "difference")
        assert difference.find_element(By.CSS_SELECTOR, ".low").text == f"{api['low']:+.3f}"
        assert difference.find_element(By.CSS_SELECTOR, ".high").text == f"{api['high']:+.3f}"
        assert difference.find_element(By.CSS_SELECTOR, ".mean").text == "+0.500"

        plot = browser.find_element(By.CSS_SELECTOR, "figure[data-series=release-mean-score]")
        points = [p.get_attribute("textContent") for p in plot.find_elements(By.CSS_SELECTOR, "circle.pt title")]
        assert points == ["release 1: 0.25", "release 2: 0.75"]  # in the order the releases served
        assert len(browser.find_elements(By.CSS_SELECTOR, "#served tr.served")) == 2

        # Another pair through the form: b - a of the same release is zero.
        Select(browser.find_element(By.NAME, "b")).select_by_value(first)
        follow(browser, By.CSS_SELECTOR, "form button")
        assert browser.find_element(By.CSS_SELECTOR, "#difference .mean").text == "+0.000"
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []

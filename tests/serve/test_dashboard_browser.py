"""The dashboard in real headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by selenium).

After a short learning run (a harness trainer reporting reward and loss, a gate rejecting every other step),
the scenario page plots one reward point per training step, the chain and the gate decisions list selected and
rejected candidates with their reasons, the records browser pages through 200+ records, an inference token
cannot roll back, and no page logs a console error. Screenshots go to ``$REEF_TEST_ARTIFACTS`` (default: the
test's tmp dir).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.serve.app import create_app
from reef_core.background import serve_asgi
from reef_core.testing.fixtures import wait_until

pytest.importorskip("selenium.webdriver")
from reef_core.testing.browser import chromium  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.expected_conditions import staleness_of  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


TOKEN, ADMIN = "ui-inference-token", "ui-admin-token"
REPORTS = 6
SCENARIO = "dash board"  # a space: names are quoted in every link


@pytest.fixture
def artifacts(tmp_path) -> Path:
    path = Path(os.environ.get("REEF_TEST_ARTIFACTS", tmp_path)) / "dashboard"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def loop_url(tmp_path, fake_upstream_url):
    cfg = compose_config([
        "engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", f"storage.data_dir={tmp_path}/data",
        f"server.tokens=[{TOKEN}]", f"server.admin_tokens=[{ADMIN}]",
        "recipe.name=dash", "recipe.processor=per_report", "+recipe.processor_options.batch_size=1",
        "recipe.trainer=reef_core.testing.dashboard_loop:RewardTrainer", "recipe.surface=harness",
        "evaluation.policy=reef_core.testing.dashboard_loop:EveryOther"])
    with serve_asgi(create_app(build_deployment(cfg)), lifespan="on") as url:
        headers = {"authorization": f"Bearer {TOKEN}", "x-reef-scenario": SCENARIO}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            receipts = []
            for i in range(200):
                answer = client.post("/v1/chat/completions", headers={"x-reef-tag-batch": str(i % 2)},
                                     json={"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]})
                assert answer.status_code == 200
                receipts.append(answer.headers["x-reef-agent-record-id"])
            for i, receipt in enumerate(receipts[:REPORTS]):
                report = client.post("/reef/report", json={"score": i / 10, "references": [receipt]})
                assert report.status_code == 200, report.text

            def steps() -> int:
                status = client.get(f"/reef/scenarios/{SCENARIO}/status").json()
                return status["counters"]["selected"] + status["counters"]["rejected"]

            wait_until(lambda: steps() >= REPORTS, timeout=60, what="every report trained and decided")
        yield url


@pytest.fixture
def browser():
    yield from chromium("1280,1600")


def follow(driver, element) -> None:
    """Click ``element`` and wait until the page it leads to has replaced this one (a click returns before a form's
    post and redirect have finished on a busy machine)."""
    page = driver.find_element(By.TAG_NAME, "html")
    element.click()
    WebDriverWait(driver, 30).until(staleness_of(page))


def sign_in(driver, url: str, token: str) -> None:
    driver.get(f"{url}/ui")
    assert driver.current_url.endswith("/ui/login")  # no cookie yet: sent to the login page
    driver.find_element(By.NAME, "token").send_keys(token)
    follow(driver, driver.find_element(By.CSS_SELECTOR, "button[type=submit]"))
    assert driver.current_url.endswith("/ui")


def console_errors(driver) -> list:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_dashboard_shows_the_loop(loop_url, browser, artifacts):
    status = httpx.get(f"{loop_url}/reef/scenarios/{SCENARIO}/status",
                       headers={"authorization": f"Bearer {TOKEN}"}).json()
    steps = status["counters"]["steps"]
    sign_in(browser, loop_url, TOKEN)
    follow(browser, browser.find_element(By.LINK_TEXT, SCENARIO))
    browser.save_screenshot(str(artifacts / "scenario.png"))

    reward = browser.find_element(By.CSS_SELECTOR, "figure[data-series=reward]")
    assert len(reward.find_elements(By.CSS_SELECTOR, "circle.pt")) == steps == REPORTS
    assert len(browser.find_elements(By.CSS_SELECTOR, "figure[data-series=loss] circle.pt")) == steps
    decisions = browser.find_elements(By.CSS_SELECTOR, "#decisions tr.decision")
    assert len(decisions) == steps
    selected = [d.text for d in decisions if "selected" in d.get_attribute("class")]
    rejected = [d.text for d in decisions if "rejected" in d.get_attribute("class")]
    assert len(selected) == len(rejected) == steps // 2
    assert all("is odd: rejected (test policy)" in text for text in rejected)
    # The chain: the seed release and one per selected step; an inference token gets no rollback link.
    assert len(browser.find_elements(By.CSS_SELECTOR, "#chain tr.release")) == 1 + len(selected)
    assert not browser.find_elements(By.PARTIAL_LINK_TEXT, "roll back")
    # The newest release's harness tree, diffed against its parent.
    follow(browser, browser.find_element(By.CSS_SELECTOR, "#chain tr.release a"))
    assert [r.text.split()[0] for r in browser.find_elements(By.CSS_SELECTOR, "#files tr.file")] == [
        "system_prompt.md"]
    diff = browser.find_element(By.CSS_SELECTOR, "pre.diff").text
    assert "-step " in diff and f"+step {steps}" in diff
    browser.save_screenshot(str(artifacts / "release.png"))
    browser.back()

    # The records browser pages through every record, 50 a page.
    follow(browser, browser.find_element(By.LINK_TEXT, "records"))
    seen: list[str] = []
    for page in range(20):
        rows = browser.find_elements(By.CSS_SELECTOR, "#records tr.record")
        seen += [row.find_element(By.TAG_NAME, "a").text for row in rows]
        if page == 0:
            browser.save_screenshot(str(artifacts / "records.png"))
        nexts = browser.find_elements(By.ID, "next")
        if not nexts:
            break
        follow(browser, nexts[0])
    assert len(seen) == len(set(seen)) == 200 + REPORTS
    # Filters: by type, then by tag.
    browser.get(f"{loop_url}/ui/scenarios/dash%20board/records?type=report")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#records tr.record")) == REPORTS
    browser.get(f"{loop_url}/ui/scenarios/dash%20board/records?tag=batch%3D1")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#records tr.record")) == 50
    follow(browser, browser.find_element(By.CSS_SELECTOR, "#records tr.record a"))
    assert "Payload" in browser.page_source and "q1" in browser.page_source
    browser.save_screenshot(str(artifacts / "record.png"))
    assert console_errors(browser) == []

    # An inference token cannot roll back: the confirmation page and the action are both refused.
    chain = httpx.get(f"{loop_url}/reef/scenarios/{SCENARIO}/releases",
                      headers={"authorization": f"Bearer {TOKEN}"}).json()["releases"]
    seed = chain[-1]["release_id"]
    browser.get(f"{loop_url}/ui/scenarios/dash%20board/rollback?release_id={seed}")
    assert "admin token" in browser.page_source
    cookie = browser.get_cookie("reef_ui_token")
    assert cookie["httpOnly"] and cookie["path"] == "/ui"
    refused = httpx.post(f"{loop_url}/ui/scenarios/dash%20board/rollback", cookies={"reef_ui_token": TOKEN},
                         data={"release_id": seed, "confirm": "yes"})
    assert refused.status_code == 403
    after = httpx.get(f"{loop_url}/reef/scenarios/{SCENARIO}/releases",
                      headers={"authorization": f"Bearer {TOKEN}"}).json()["releases"]
    assert after[0]["release_id"] == chain[0]["release_id"]  # the head did not move
    for name in ("scenario.png", "release.png", "records.png", "record.png"):
        assert (artifacts / name).stat().st_size > 1000


def test_admin_rolls_back_after_confirming(loop_url, browser, artifacts):
    sign_in(browser, loop_url, ADMIN)
    browser.get(f"{loop_url}/ui/scenarios/dash%20board")
    links = browser.find_elements(By.PARTIAL_LINK_TEXT, "roll back")
    assert links
    follow(browser, links[-1])  # the oldest release: the seed
    assert "Confirm rollback" in browser.title
    follow(browser, browser.find_element(By.ID, "confirm"))
    browser.save_screenshot(str(artifacts / "rolled-back.png"))
    operations = [td.text for td in browser.find_elements(By.CSS_SELECTOR, "#chain tr.release td:nth-child(2)")]
    assert operations[0] == "rollback"
    assert console_errors(browser) == []

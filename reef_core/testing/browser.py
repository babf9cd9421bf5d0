"""Test support: Debian's headless Chromium through Selenium, for the dashboard's browser tests."""

from __future__ import annotations

import os
import shutil
from typing import Iterator

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def chromium(window: str = "1280,1600") -> Iterator:
    """Yield a headless Chrome driver (``--no-sandbox``: tests run as root) that keeps the console log; skip the
    test without Chromium, but fail it under CI, whose setup installs Chromium (missing there is a defect)."""
    import pytest
    from selenium import webdriver

    if not (CHROMIUM and DRIVER):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromedriver are not installed")
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/setup.sh installs them as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={window}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()

"""One Playwright driver and one headless Chromium for all the chat page's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from page_driver import launch
from playwright.sync_api import Browser, sync_playwright


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = launch(playwright)
        yield chromium
        chromium.close()

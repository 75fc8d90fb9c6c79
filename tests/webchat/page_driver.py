"""A real headless Chromium for the chat page's tests, and what they read off the page.

The browser is the system's (Debian's ``chromium`` package, which ``make test``
installs where missing), driven by Playwright; ``playwright install`` is never
run. ``EMBER_CHROMIUM`` points at another binary.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, Playwright

from server_process import LOG_DIR

CHROMIUM = os.environ.get("EMBER_CHROMIUM", "/usr/bin/chromium")
# As root in a container: no sandbox; no GPU, no QUIC, nothing fetched in the background.
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
SCREENSHOTS = LOG_DIR / "webchat"

LAST_TURN = "article.assistant:last-of-type"
# The last answer once its turn has ended, whatever the ending.
TURN_ENDED = f"{LAST_TURN}:not([data-state=sending]):not([data-state=streaming]):not([data-state=waiting])"


def launch(playwright: Playwright) -> Browser:
    """Chromium, headless, with a fresh profile (Playwright makes a new user-data-dir per launch)."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package (`make test` does), or set EMBER_CHROMIUM")
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)


@dataclass
class ChatPage:
    """The chat page open in a browser context of its own (fresh storage).

    ``errors`` collects uncaught exceptions and console errors (a
    Content-Security-Policy violation is one), but not the browser's own line
    for each HTTP error answer (the 401s and 429s the page handles).
    """

    page: Page
    errors: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, browser: Browser, url: str, viewport: dict[str, int] = DESKTOP) -> ChatPage:
        context = browser.new_context(viewport=viewport)
        context.set_default_timeout(30_000)
        chat = cls(context.new_page())
        chat.page.on("pageerror", lambda exc: chat.errors.append(f"uncaught: {exc}"))
        chat.page.on("console", lambda msg: chat._console(msg.type, msg.text))
        chat.page.goto(url)
        return chat

    def _console(self, kind: str, text: str) -> None:
        if kind == "error" and not text.startswith("Failed to load resource: the server responded with a status of"):
            self.errors.append(f"console: {text}")

    def close(self) -> None:
        self.page.context.close()

    def send(self, text: str) -> None:
        """Type ``text`` into the message box and press Enter, as a person would."""
        self.page.focus("#input")
        self.page.keyboard.type(text)
        self.page.keyboard.press("Enter")

    def wait_turn_end(self, timeout_ms: float = 60_000) -> str:
        """Wait until the last turn has ended; return its ending (done, stopped, error, deadline, length...)."""
        return self.page.wait_for_selector(TURN_ENDED, timeout=timeout_ms).get_attribute("data-state") or ""

    def last_text(self) -> str:
        return self.page.text_content(f"{LAST_TURN} .text") or ""

    def last_status(self) -> str:
        return self.page.text_content(f"{LAST_TURN} .status") or ""

    def last_stats(self) -> dict[str, str]:
        """The last turn's figures by key (ttft, rate, completion, prompt, cached, tier, retries...)."""
        return self.page.eval_on_selector_all(
            f"{LAST_TURN} .stats [data-stat]", "spans => Object.fromEntries(spans.map(s => [s.dataset.stat, s.textContent]))"
        )

    def record_text_steps(self) -> None:
        """Record every distinct text the last answer shows from now on (read back with ``text_steps``)."""
        self.page.evaluate(
            """() => {
                window.__steps = [];
                window.__observer?.disconnect();
                window.__observer = new MutationObserver(() => {
                    const text = document.querySelector("article.assistant:last-of-type .text")?.textContent ?? "";
                    if (text && text !== window.__steps.at(-1)) window.__steps.push(text);
                });
                window.__observer.observe(document.getElementById("log"), {childList: true, subtree: true, characterData: true});
            }"""
        )

    def text_steps(self) -> list[str]:
        return self.page.evaluate("() => window.__steps")

    def screenshot(self, name: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / name
        self.page.screenshot(path=str(path))
        return path

    def fits_width(self) -> bool:
        """No horizontal scrolling: the page is no wider than the viewport."""
        return self.page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")


def number_in(label: str) -> int:
    """The integer in a label such as 'cached 48'."""
    match = re.search(r"\d+", label)
    assert match, f"no number in {label!r}"
    return int(match.group())

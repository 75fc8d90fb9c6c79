"""The chat page against a real ``ember serve`` (and ``ember route``), in a real headless Chromium.

One server for the module, started as the overload test needs it
(``--max-queue 0 --max-running 1``: a second request while one runs is a 429)
and with an API key, so every page here also goes through asking for the key.
The other tests run one request at a time, which those limits allow.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import httpx
import pytest
from page_driver import PHONE, ChatPage, number_in
from playwright.sync_api import Browser
from server_process import ServerProcess, metric_value

API_KEY = "sk-webchat-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TTFT = re.compile(r"^TTFT \d+(?: ms|\.\d+ s)$")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--max-queue", "0", "--max-running", "1", "--api-key", API_KEY, threads=1) as proc:
        yield proc


def open_chat(browser: Browser, url: str, *, temperature: str = "0", max_tokens: str | None = None) -> ChatPage:
    """The page, past its API-key prompt, with the settings a test wants (typed into the settings form)."""
    chat = ChatPage.open(browser, url)
    page = chat.page
    page.wait_for_selector("#notice:not([hidden])")
    assert "needs an API key" in (page.text_content("#notice") or "")
    assert page.is_visible("#settings") and page.evaluate("() => document.activeElement.id") == "api-key"
    page.keyboard.type(API_KEY)
    page.keyboard.press("Tab")  # the key is committed on change; the page asks for the model again
    page.wait_for_function("() => document.getElementById('model').textContent === 'SmolLM2-135M-Instruct'")
    assert page.is_hidden("#notice")
    page.fill("#temperature", temperature)
    if max_tokens is not None:
        page.fill("#max-tokens", max_tokens)
    page.click("#settings-toggle")  # close the settings
    return chat


def running(server: ServerProcess) -> float:
    return metric_value(server.metrics(), "llm_requests_running")


def wait_running(server: ServerProcess, value: float, timeout_s: float = 10.0) -> None:
    """Poll /metrics until llm_requests_running reads ``value`` (the engine updates it every step)."""
    import time

    deadline = time.monotonic() + timeout_s
    while (now := running(server)) != value:
        assert time.monotonic() < deadline, f"llm_requests_running stayed {now}, expected {value}"
        time.sleep(0.05)


@pytest.mark.timeout(400)  # the first test also waits for the server to load the model
def test_answers_stream_and_turn_two_is_hot_with_cached_tokens(browser: Browser, server: ServerProcess) -> None:
    chat = open_chat(browser, server.base + "/")
    assert chat.page.input_value("#max-tokens") == "80"  # the support preset
    chat.record_text_steps()
    chat.send("What is the capital of France?")
    assert chat.wait_turn_end() in ("done", "length")
    steps = chat.text_steps()
    assert len(steps) >= 2, f"the answer appeared in one piece: {steps}"
    assert steps[-1] == chat.last_text() and len(steps[0]) < len(steps[-1])
    first = chat.last_stats()
    assert TTFT.match(first["ttft"]), first
    assert first["tier"] in ("hot", "warm", "cold")
    assert number_in(first["prompt"]) > 0 and "rate" in first

    chat.send("And what is the capital of Italy?")
    assert chat.wait_turn_end() in ("done", "length")
    second = chat.last_stats()
    assert TTFT.match(second["ttft"]), second
    assert second["tier"] == "hot"
    cached = number_in(second["cached"])
    # Turn 1's prompt and answer are this prompt's prefix, kept in the pool (less the last partial block).
    assert cached >= number_in(first["prompt"]) // 16 * 16 > 0, (first, second)

    # The server knows the page's conversation under the id the page shows.
    session_id = chat.page.text_content("#session-id")
    session = httpx.get(f"{server.url}/sessions/{session_id}", headers=AUTH, timeout=10)
    assert session.status_code == 200 and session.json()["tier"] == "hot"

    chat.screenshot("chat-desktop.png")
    chat.page.set_viewport_size(PHONE)
    assert chat.fits_width()
    chat.screenshot("chat-phone.png")
    assert chat.errors == []
    chat.close()


@pytest.mark.timeout(120)
def test_stop_mid_stream_aborts_the_request_on_the_server(browser: Browser, server: ServerProcess) -> None:
    chat = open_chat(browser, server.base + "/")
    page = chat.page
    page.click("#settings-toggle")
    page.select_option("#preset", "creative")  # 300 tokens: far more than the time to press stop
    page.click("#settings-toggle")
    chat.send("Write a long story about a dragon.")
    page.wait_for_function(
        "() => { const a = document.querySelector('article.assistant:last-of-type');"
        " return a.dataset.state === 'streaming' && a.querySelector('.text').textContent.length > 0; }"
    )
    assert running(server) == 1  # the answer is being generated
    page.click("#stop")
    assert chat.wait_turn_end() == "stopped"
    wait_running(server, 0)  # the server aborted it: nothing left in the engine's running set
    partial = chat.last_text()
    assert partial and "Stopped." in chat.last_status()
    assert "prompt" not in chat.last_stats()  # no usage chunk: the stream was cut before the end
    entry = [e for e in server.access_log(200) if e["path"] == "/v1/chat/completions"][-1]
    assert entry["max_tokens"] == 300 and "finish_reason" not in entry  # it never finished: it was aborted
    assert chat.errors == []
    chat.close()


@pytest.mark.timeout(120)
def test_overload_shows_the_retry_after_wait_then_the_answer(browser: Browser, server: ServerProcess) -> None:
    chat = open_chat(browser, server.base + "/", max_tokens="12")
    admitted, release = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def hold_the_only_slot() -> None:
        # Held until released (closing the stream aborts it): more tokens than the test takes to run.
        body = {"messages": [{"role": "user", "content": "Count to one thousand."}], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/chat/completions", json=body, headers=AUTH, timeout=60) as response:
                assert response.status_code == 200
                for _ in response.iter_lines():
                    admitted.set()
                    if release.is_set():
                        return  # closing the stream aborts the request on the server
        except BaseException as exc:  # reported by the test below
            failures.append(exc)
        finally:
            admitted.set()

    holder = threading.Thread(target=hold_the_only_slot, daemon=True)
    holder.start()
    try:
        assert admitted.wait(30) and not failures, failures
        chat.send("Hi")
        wait = chat.page.wait_for_selector("article.assistant:last-of-type[data-state=waiting] .status.wait")
        assert re.search(r"^Server busy \(429\): .+ Retrying in \d+ s…$", wait.text_content() or ""), wait.text_content()
        # The wait is the server's Retry-After (whole seconds, at least 1), not a guess of the page's.
        wait_ms = int(chat.page.get_attribute("article.assistant:last-of-type", "data-wait-ms") or "0")
        assert wait_ms >= 1000 and wait_ms % 1000 == 0
    finally:
        release.set()
        holder.join(30)
    assert not failures, failures
    assert chat.wait_turn_end(timeout_ms=60_000) in ("done", "length")
    assert chat.last_text()
    assert chat.last_stats()["retries"].startswith("served after ")
    assert any(e["path"] == "/v1/chat/completions" for e in server.access_log(429))
    assert chat.errors == []
    chat.close()


@pytest.mark.timeout(120)
def test_the_router_serves_the_same_page_and_routes_its_calls(browser: Browser, server: ServerProcess) -> None:
    with ServerProcess("--upstream", server.base, command="route") as router:
        assert httpx.get(router.base + "/").content == httpx.get(server.base + "/").content
        assert httpx.get(router.base + "/webchat/chat.js").content == httpx.get(server.base + "/webchat/chat.js").content
        chat = open_chat(browser, router.base + "/", max_tokens="8")
        chat.send("Hi")
        assert chat.wait_turn_end() in ("done", "length")
        assert chat.last_text() and chat.last_stats()["tier"] in ("hot", "warm", "cold")
        # The page only talks to its own origin (connect-src 'self'): the answer came through the router.
        assert metric_value(router.metrics(), "ember_router_requests_total", {"code": "200"}) >= 1
        assert chat.errors == []
        chat.close()

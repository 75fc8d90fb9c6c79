"""The chat page's rendering, failure displays and keyboard use, in a real Chromium.

The words come from a scripted ``/v1/chat/completions`` (see
``scripted_server``: a real model cannot be made to answer ``<script>`` or to
break off on cue); the page, the browser, HTTP and SSE are real.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from page_driver import PHONE, ChatPage
from playwright.sync_api import Browser
from scripted_server import ScriptedChat, ServerThread

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[ScriptedChat, str]]:
    chat = ScriptedChat()
    server = ServerThread(chat.app)
    yield chat, server.url
    server.stop()


@pytest.fixture
def chat(browser: Browser, scripted: tuple[ScriptedChat, str]) -> Iterator[ChatPage]:
    page = ChatPage.open(browser, scripted[1] + "/")
    page.page.wait_for_function("() => document.getElementById('model').textContent === 'scripted-model'")
    yield page
    assert page.errors == []
    page.close()


def test_page_files_come_from_the_package_with_a_strict_policy(scripted: tuple[ScriptedChat, str]) -> None:
    base = scripted[1]
    page = httpx.get(base + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "default-src 'none'" in policy
    assert "http" not in page.text.replace("http-equiv", ""), "the page must load nothing from another origin"
    for name in ("chat.js", "markdown.js", "sse.js", "stats.js", "style.css", "icon.svg"):
        asset = httpx.get(f"{base}/webchat/{name}")
        assert asset.status_code == 200, name
        assert asset.headers["x-content-type-options"] == "nosniff"
    missing = httpx.get(base + "/webchat/__init__.py")  # only the listed files, nothing else in the package
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(base + "/webchat/..%2F__init__.py").status_code == 404


def test_model_output_markup_is_shown_as_text(chat: ChatPage) -> None:
    chat.send("markup please")
    assert chat.wait_turn_end() == "done"
    text = chat.last_text()
    assert "<script>window.__pwned = 1</script>" in text
    assert '<img src="x" onerror="window.__pwned = 2">' in text
    assert '<iframe src="https://example.com"></iframe>' in text  # the code block, verbatim
    answer = chat.page.locator("article.assistant:last-of-type .text")
    assert answer.locator("script, img, iframe, [onerror]").count() == 0
    assert answer.locator("b").count() == 0 and answer.locator("strong").count() == 1  # Markdown bold, HTML tags as text
    assert answer.locator("pre code").count() == 1
    hrefs = answer.locator("a").evaluate_all("links => links.map(a => a.href)")
    assert hrefs == ["https://example.com/a"]  # the javascript: link stayed text
    assert "[bad link](javascript:window.__pwned=3)" in text
    assert chat.page.evaluate("() => window.__pwned") is None


def test_a_deadline_keeps_the_partial_answer_and_says_why(chat: ChatPage) -> None:
    chat.send("deadline")
    assert chat.wait_turn_end() == "deadline"
    assert chat.last_text() == "The answer starts well and then"
    assert "Deadline passed" in chat.last_status() and "stop_reason: timeout" in chat.last_status()
    assert chat.last_stats()["tier"] == "cold"


def test_a_mid_stream_error_keeps_the_partial_answer_in_view_and_in_the_conversation(chat: ChatPage, scripted: tuple[ScriptedChat, str]) -> None:
    server = scripted[0]
    chat.send("broken")
    assert chat.wait_turn_end() == "error"
    assert chat.last_text() == "The answer starts well and then"
    assert "broke off: Internal error while generating." in chat.last_status()
    chat.send("next question")
    assert chat.wait_turn_end() == "done"
    messages = server.requests[-1]["body"]["messages"]
    assert messages == [
        {"role": "user", "content": "broken"},
        {"role": "assistant", "content": "The answer starts well and then"},
        {"role": "user", "content": "next question"},
    ]


def test_retry_after_ms_is_counted_down_then_the_turn_is_retried(chat: ChatPage, scripted: tuple[ScriptedChat, str]) -> None:
    server = scripted[0]
    before = len(server.requests)
    chat.send("busy")
    waiting = chat.page.wait_for_selector("article.assistant:last-of-type[data-state=waiting] .status.wait")
    assert "Server busy (429): Too many requests are waiting." in (waiting.text_content() or "")
    # retry-after-ms (400) is more precise than Retry-After (5 s) and wins.
    assert chat.page.get_attribute("article.assistant:last-of-type", "data-wait-ms") == "400"
    assert chat.wait_turn_end(timeout_ms=4_000) == "done"
    assert len(server.requests) == before + 2
    assert chat.last_stats()["retries"] == "served after 1 retry (429, waited 400 ms)"


def test_keyboard_only_enter_sends_shift_enter_breaks_escape_stops(chat: ChatPage, scripted: tuple[ScriptedChat, str]) -> None:
    server = scripted[0]
    server.disconnected.clear()
    before = len(server.requests)
    page = chat.page
    page.focus("#input")
    page.keyboard.type("endless one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("two")
    assert page.input_value("#input") == "endless one\ntwo"
    assert len(server.requests) == before  # Shift+Enter sent nothing
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.querySelector('article.assistant:last-of-type .text').textContent.includes('and then')")
    assert server.requests[-1]["body"]["messages"][-1]["content"] == "endless one\ntwo"
    assert page.is_visible("#stop") and page.is_disabled("#send")
    page.keyboard.press("Escape")
    assert chat.wait_turn_end() == "stopped"
    assert server.disconnected.wait(5), "the server never saw the browser go away"
    assert chat.last_text() == "The answer starts well and then" and "Stopped." in chat.last_status()
    assert page.is_hidden("#stop") and page.is_enabled("#send")


def test_new_conversation_sends_a_new_session_id_and_an_empty_history(chat: ChatPage, scripted: tuple[ScriptedChat, str]) -> None:
    server = scripted[0]
    chat.send("hello")
    chat.wait_turn_end()
    first = server.requests[-1]["headers"]["x-session-id"]
    assert first == chat.page.text_content("#session-id")
    chat.page.click("#new-chat")
    assert chat.page.locator("article").count() == 0
    chat.send("again")
    chat.wait_turn_end()
    second = server.requests[-1]
    assert second["headers"]["x-session-id"] not in ("", first)
    assert second["body"]["messages"] == [{"role": "user", "content": "again"}]
    assert second["body"]["stream_options"] == {"include_usage": True}


def test_settings_presets_and_the_phone_layout(browser: Browser, scripted: tuple[ScriptedChat, str]) -> None:
    server, url = scripted
    chat = ChatPage.open(browser, url + "/", viewport=PHONE)
    page = chat.page
    page.click("#settings-toggle")
    assert page.input_value("#max-tokens") == "80"  # the support preset
    page.select_option("#preset", "creative")
    assert page.input_value("#max-tokens") == "300"
    page.fill("#temperature", "0.2")
    page.fill("#api-key", "sk-test")
    page.click("#settings-toggle")
    chat.send("a question long enough to wrap on a phone screen, with a_very_long_identifier_that_does_not_break_anywhere_at_all_really")
    assert chat.wait_turn_end() == "done"
    sent = server.requests[-1]
    assert sent["body"]["max_tokens"] == 300 and sent["body"]["temperature"] == 0.2
    assert sent["headers"]["authorization"] == "Bearer sk-test"
    assert chat.fits_width()
    box = page.locator("#send").bounding_box()
    assert box is not None and box["x"] + box["width"] <= PHONE["width"] and box["y"] + box["height"] <= PHONE["height"]
    page.reload()  # settings survive a reload (the key only for this tab)
    page.click("#settings-toggle")
    assert page.input_value("#preset") == "creative" and page.input_value("#temperature") == "0.2"
    assert chat.errors == []
    chat.close()


MARKDOWN_CASES = [
    ("plain *em* **strong** `co*de*` ~~gone~~", "<p>plain <em>em</em> <strong>strong</strong> <code>co*de*</code> <del>gone</del></p>"),
    ("snake_case_name stays, _this_ is em", "<p>snake_case_name stays, <em>this</em> is em</p>"),
    ("line one\nline two", "<p>line one\nline two</p>"),
    ("# Title\n\ntext", "<h1>Title</h1><p>text</p>"),
    ("- a\n- b\n  - b1\n- c", "<ul><li>a</li><li><p>b</p><ul><li>b1</li></ul></li><li>c</li></ul>"),
    ("3. three\n4. four", '<ol start="3"><li>three</li><li>four</li></ol>'),
    ("> quoted\n> more\n\nafter", "<blockquote><p>quoted\nmore</p></blockquote><p>after</p>"),
    ("---", "<hr>"),
    ("```py\nx = '<b>'\n```\nafter", '<pre data-lang="py"><code>x = \'&lt;b&gt;\'</code></pre><p>after</p>'),
    ("```\nstill streaming", "<pre><code>still streaming</code></pre>"),
    ("see https://example.com/x.", '<p>see <a href="https://example.com/x" target="_blank" rel="noopener noreferrer nofollow">https://example.com/x</a>.</p>'),
    ("![cat](https://example.com/cat.png)", '<p><a href="https://example.com/cat.png" target="_blank" rel="noopener noreferrer nofollow">image: cat</a></p>'),
    ("[x](data:text/html,hi) [y](/relative)", "<p>[x](data:text/html,hi) [y](/relative)</p>"),
    ("<b>not bold</b> & co", "<p>&lt;b&gt;not bold&lt;/b&gt; &amp; co</p>"),
]


def test_markdown_subset_renders_to_elements_and_text(chat: ChatPage) -> None:
    """The page's own renderer (its module, loaded by the page), on the constructs chat answers use."""
    rendered = chat.page.evaluate(
        """async (cases) => {
            const { renderMarkdown } = await import("/webchat/markdown.js");
            return cases.map(([source]) => {
                const box = document.createElement("div");
                box.append(renderMarkdown(source));
                return box.innerHTML;  // serialised only to compare: the page never parses HTML
            });
        }""",
        MARKDOWN_CASES,
    )
    assert rendered == [expected for _, expected in MARKDOWN_CASES]

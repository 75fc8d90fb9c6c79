"""UTF-16 surrogates in any text field of either endpoint, streamed or not: a 400 in OpenAI's shape.

JSON can spell a surrogate (``"\\ud800"``); Python decodes it into a string
no tokenizer takes (it used to be a TypeError inside the tokenizer, a 500
logged twice). A correctly paired escape is a real character and is served.
Bodies are written with ``json.dumps``, which escapes surrogates exactly as
a client would send them.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

LONE_HIGH = "\ud800"
LONE_LOW = "\udc00"
MISORDERED_PAIR = "\ude00\ud83d"  # low then high: two lone surrogates, not a character
HIGH_HIGH = "\ud83d\ud83d"
BAD = {"lone high": LONE_HIGH, "lone low": LONE_LOW, "misordered pair": MISORDERED_PAIR, "two highs": HIGH_HIGH}
USER = {"role": "user", "content": "Hi"}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def chat_case(param: str, build) -> tuple[str, str, object]:
    return ("chat/completions", param, build)


# (endpoint, the param the error must name, body builder taking the hostile text)
CASES = [
    chat_case("messages.0.content", lambda s: {"messages": [{"role": "user", "content": f"hi {s} there"}]}),
    chat_case("messages.0.content.1.text", lambda s: {"messages": [{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": s}]}]}),
    chat_case("messages.0.content", lambda s: {"messages": [{"role": "system", "content": f"You are {s}."}, USER]}),
    chat_case("messages.0.name", lambda s: {"messages": [{"role": "user", "content": "Hi", "name": s}]}),
    chat_case("messages.1.content", lambda s: {"messages": [USER, {"role": "assistant", "content": s}, USER]}),
    chat_case("messages.1.tool_calls.0.function.arguments", lambda s: {"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "' + s + '"}'}}]}, USER]}),
    chat_case("messages.1.tool_call_id", lambda s: {"messages": [USER, {"role": "tool", "tool_call_id": s, "content": "sunny"}]}),
    chat_case("stop", lambda s: {"messages": [USER], "stop": s}),
    chat_case("stop.1", lambda s: {"messages": [USER], "stop": ["\n", s]}),
    chat_case("tools.0.function.description", lambda s: {"messages": [USER], "tools": [{**TOOL, "function": {**TOOL["function"], "description": s}}]}),
    chat_case("tools.0.function.parameters.properties.city.description", lambda s: {"messages": [USER], "tools": [
        {**TOOL, "function": {**TOOL["function"], "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": s}}}}}]}),
    chat_case("response_format.json_schema.schema.properties.name.description", lambda s: {"messages": [USER], "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "properties": {"name": {"type": "string", "description": s}}}}}}),
    chat_case("user", lambda s: {"messages": [USER], "user": s}),
    chat_case("session_id", lambda s: {"messages": [USER], "session_id": s}),
    chat_case("model", lambda s: {"messages": [USER], "model": s}),
    chat_case("x_not_openai.nested.0", lambda s: {"messages": [USER], "x_not_openai": {"nested": [s]}}),  # ignored, still text
    ("completions", "prompt", lambda s: {"prompt": s}),
    ("completions", "prompt.0", lambda s: {"prompt": [f"Once {s}"]}),
    ("completions", "stop.0", lambda s: {"prompt": "Once", "stop": [s]}),
    ("completions", "user", lambda s: {"prompt": "Once", "user": s}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("endpoint,param,build", CASES, ids=[f"{c[0].split('/')[0]}:{c[1]}" for c in CASES])
def test_surrogates_in_any_text_field_are_a_400(server, endpoint, param, build, kind, stream):
    body = {**build(BAD[kind]), "stream": stream, "max_tokens": 4}
    raw = json.dumps(body).encode()  # ensure_ascii: surrogates become \\udXXX escapes
    assert b"\\ud" in raw
    r = httpx.post(f"{server.url}/{endpoint}", content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")  # an error body, not an event stream
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert error["param"] == param, error
    assert "surrogate" in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_a_correctly_paired_surrogate_escape_is_its_character(server, stream):
    # "\ud83d\ude00" in JSON is U+1F600; it is text like any other.
    for endpoint, body in (("chat/completions", {"messages": [{"role": "user", "content": "Say \ud83d\ude00"}]}), ("completions", {"prompt": "\ud83d\ude00"})):
        raw = json.dumps({**body, "max_tokens": 2, "stream": stream}).encode()
        assert b"\\ud83d\\ude00" in raw
        r = httpx.post(f"{server.url}/{endpoint}", content=raw, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 200, r.text


def test_surrogates_on_tokenize_are_a_400(server):
    for body in ({"prompt": LONE_HIGH}, {"messages": [{"role": "user", "content": MISORDERED_PAIR}]}):
        r = httpx.post(f"{server.base}/tokenize", content=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400, r.text
        assert "surrogate" in r.json()["error"]["message"]

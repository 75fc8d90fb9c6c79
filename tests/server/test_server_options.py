"""`ember serve` options of this feature: --chat-template, --profile / --default-*, and a server without the grammar library."""

from __future__ import annotations

import httpx
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.timeout(300)

# A tools-aware template: it reads `tools` and Hugging Face-shaped tool calls itself.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
Tools available:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is 2 plus 3?"}]


@pytest.fixture(scope="module")
def template_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    with ServerProcess("--chat-template", str(template), "--profile", "creative", "--default-temperature", "0.5", "--warmup-requests", "0") as proc:
        yield proc


def test_chat_template_file_renders_tools_itself(template_server):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    ids = httpx.post(f"{template_server.base}/tokenize", json={"messages": messages, "tools": [TOOL]}, timeout=30).json()["tokens"]
    text = httpx.post(f"{template_server.base}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert "Tools available: add" in text
    assert 'CALL add {"a": 2, "b": 3}' in text  # arguments handed to the template as a mapping
    assert "<tools>" not in text  # Ember's own tool section is not added to a template that renders tools


def test_calls_are_still_constrained_with_another_template(template_server):
    r = httpx.post(
        f"{template_server.url}/chat/completions",
        json={"messages": ASK, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 40, "timeout": 120},
        timeout=150,
    ).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", r
    arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
    import json

    assert set(json.loads(arguments)) == {"a", "b"}


def test_profile_and_default_overrides_show_in_models(template_server):
    defaults = httpx.get(f"{template_server.url}/models", timeout=30).json()["data"][0]["generation_defaults"]
    assert defaults["temperature"] == 0.5 and defaults["sources"]["temperature"] == "server"
    assert defaults["top_p"] == 0.95 and defaults["sources"]["top_p"] == "profile"  # creative: warmer
    assert defaults["max_tokens"] == 300


def test_a_bad_template_file_stops_serve_at_once(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    proc = ServerProcess("--chat-template", str(bad))
    assert proc.proc.wait(60) != 0
    assert "--chat-template" in proc.log()
    proc.stop()


def test_without_the_grammar_library_structured_requests_are_400(tmp_path_factory):
    # An import shim that fails like a missing package: the real server, the extra absent.
    shim = tmp_path_factory.mktemp("no_llguidance")
    (shim / "llguidance").mkdir()
    (shim / "llguidance" / "__init__.py").write_text("raise ImportError('llguidance is not installed')\n")
    with ServerProcess("--warmup-requests", "0", env={"PYTHONPATH": str(shim)}) as proc:
        def post(body):
            return httpx.post(f"{proc.url}/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)

        for body, param in (({"response_format": {"type": "json_object"}}, "response_format"), ({"tools": [TOOL], "tool_choice": "required"}, "tools")):
            r = post(body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and "ember[structured]" in error["message"]
        assert post({}).status_code == 200  # everything else works
        assert post({"tools": [TOOL], "tool_choice": "none"}).status_code == 200  # no call possible, no grammar needed

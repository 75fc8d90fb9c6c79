"""Every field the official openai client can send is either implemented or a 400 naming it.

The field lists come from the installed ``openai`` package's request types, so a
field a new client version adds fails here until Ember handles it.
"""

from __future__ import annotations

import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from ember.server.protocol import ChatCompletionRequest, CompletionRequest
from ember.server.unsupported import CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED

pytestmark = pytest.mark.timeout(300)

# A value each unsupported field may carry in a real request (anything not "off").
SAMPLE_VALUES = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "web_search_options": {},
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "store": True,
    "metadata": {"team": "a"},
    "service_tier": "flex",
    "reasoning_effort": "low",
    "verbosity": "low",
    "moderation": {"type": "auto"},
    "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "auto"},
    "prompt_cache_retention": "24h",
    "safety_identifier": "user-1",
    "suffix": " the end",
    "best_of": 3,
}


def fields_of(params_module) -> set[str]:
    return set(params_module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def implemented(model) -> set[str]:
    return {info.alias or name for name, info in model.model_fields.items()}


@pytest.mark.parametrize(
    "path,client_fields,model,table,base",
    [
        ("chat/completions", fields_of(chat_params), ChatCompletionRequest, CHAT_UNSUPPORTED, {"messages": [{"role": "user", "content": "hi"}]}),
        ("completions", fields_of(completion_params), CompletionRequest, COMPLETION_UNSUPPORTED, {"prompt": "hi"}),
    ],
)
def test_each_client_field_is_implemented_or_refused_by_name(server, path, client_fields, model, table, base):
    unhandled = client_fields - implemented(model) - set(table)
    assert not unhandled, f"openai sends {sorted(unhandled)}, which Ember neither implements nor refuses"
    refused = sorted(client_fields - implemented(model))
    assert refused, "nothing to check"
    for field in refused:
        value = SAMPLE_VALUES.get(field, "unsupported-value")
        r = httpx.post(f"{server.url}/{path}", json={**base, "max_tokens": 1, field: value}, timeout=30)
        assert r.status_code == 400, (field, r.status_code, r.text)
        error = r.json()["error"]
        assert error["param"] == field and error["type"] == "invalid_request_error", (field, error)
        assert field in error["message"]


def test_harmless_values_and_foreign_fields_pass(server):
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for extra in ({"store": False}, {"modalities": ["text"]}, {"service_tier": "auto"}, {"metadata": None}, {"some_other_servers_field": 1}):
        r = httpx.post(f"{server.url}/chat/completions", json={**base, **extra}, timeout=30)
        assert r.status_code == 200, (extra, r.text)


def test_the_openai_client_gets_the_400(server):
    import openai

    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="ember", messages=[{"role": "user", "content": "hi"}], audio={"voice": "alloy", "format": "wav"})
    assert info.value.body["param"] == "audio"
